"""SamplingParams: how one request's tokens are chosen and when its generation stops."""

from dataclasses import dataclass

from deployments.engine.errors import InvalidSamplingParams

MAX_STOP_STRINGS = 8
MAX_STOP_STRING_CHARS = 256
# Below this, dividing a logit by the penalty overflows float32 (inf, then NaN probabilities).
MIN_REPETITION_PENALTY = 1e-6
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs
MAX_N = 128  # choices per prompt; deployments set a lower limit for tenants
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_SCHEMA_CHARS = 65536  # a JSON Schema document's text
MAX_STOP_TOKEN_IDS = 64  # more would be a mistake: each is a set lookup per token, and masked with min_tokens


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """Constrain the output to JSON matching `json_schema`, by masking every token the grammar forbids.

    With `begin`/`end` the JSON sits between those literal texts (a tool call: `<tool_call>` ...
    `</tool_call>`); with `repeat`, one or more such blocks follow each other, one per line (parallel tool
    calls). JSON is compact (no free whitespace between tokens), so a model cannot spend its max_tokens on
    blanks. With `triggered`, free text comes first and the blocks are optional: nothing is constrained
    until the output writes `begin`, and from there on it is the blocks and nothing else (tool_choice
    "auto": a call, once begun, completes). Compiled grammars are cached by this value: equal specs compile
    once per engine.
    """

    json_schema: str  # a JSON Schema document as text; '{"type": "object"}' for json_object
    begin: str = ""
    end: str = ""
    repeat: bool = False
    triggered: bool = False  # free text first; constrained from the first `begin` on
    param: str = "response_format"  # the request field that asked for it, named in errors

    def __post_init__(self) -> None:
        if len(self.json_schema) > MAX_SCHEMA_CHARS:
            raise InvalidSamplingParams(
                f"the JSON schema has {len(self.json_schema):,} characters; at most {MAX_SCHEMA_CHARS:,}"
                " are accepted",
                param=self.param,
            )
        if (self.repeat or self.triggered) and not (self.begin and self.end):
            what = "repeated" if self.repeat else "triggered"
            raise InvalidSamplingParams(f"{what} blocks need begin and end texts", param=self.param)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Validated on construction; every error names the field, the value and the limit.

    Order of application (as vLLM and HF): penalties -> temperature -> top-k -> top-p -> min-p -> sample.
    temperature == 0 means greedy (argmax after penalties).
    """

    max_tokens: int | None = 16  # None: until EOS, a stop, or the model's context is full; 0: prompt only
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF/CTRL style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0  # OpenAI style, over output tokens
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids are masked, and stop strings unchecked, until this many
    skip_special_tokens: bool = True
    n: int = 1  # choices per prompt; they share the prompt's KV blocks
    logprobs: int | None = None  # per output token: its logprob and this many top alternatives (0-20)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (echo)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), OpenAI's rule
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        def bad(name: str, value: object, limit: str) -> InvalidSamplingParams:
            return InvalidSamplingParams(f"{name} must be {limit}, got {value!r}", param=name)

        if self.max_tokens is not None and self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise bad("max_tokens", self.max_tokens, ">= 1 (0 only with prompt logprobs)")
        if not 0.0 <= self.temperature <= 2.0:
            raise bad("temperature", self.temperature, "between 0 and 2")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", self.top_k, ">= 0 (0 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "between 0 and 1")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", self.repetition_penalty, f"in [{MIN_REPETITION_PENALTY:g}, 10]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "between -2 and 2")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "between -2 and 2")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise bad("seed", self.seed, "between 0 and 2**63 - 1")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", list(self.stop), f"at most {MAX_STOP_STRINGS} strings")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise bad("stop", s, f"a non-empty string of at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(t < 0 for t in self.stop_token_ids):
            raise bad(
                "stop_token_ids", list(self.stop_token_ids), f"at most {MAX_STOP_TOKEN_IDS} token ids >= 0"
            )
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", self.min_tokens, ">= 0 and at most max_tokens")
        if not 1 <= self.n <= MAX_N:
            raise bad("n", self.n, f"between 1 and {MAX_N}")
        for name, k in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise bad(name, k, f"between 0 and {MAX_LOGPROBS}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"{len(self.logit_bias)} entries", f"at most {MAX_LOGIT_BIAS} entries")
        if self.structured is not None and self.ignore_eos:
            raise bad("ignore_eos", True, "false with structured output (a complete grammar ends with EOS)")
        if self.structured is not None and self.min_tokens:
            # a complete grammar allows only EOS: masking it would leave no token to sample
            raise bad(
                "min_tokens", self.min_tokens, "0 with structured output (a complete grammar ends with EOS)"
            )
        for token, bias in self.logit_bias:
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise bad("logit_bias", {token: bias}, "token ids >= 0 with biases between -100 and 100")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
