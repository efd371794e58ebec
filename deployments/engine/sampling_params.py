"""SamplingParams: how one request's tokens are chosen and when its generation stops."""

from dataclasses import dataclass

from deployments.engine.errors import InvalidSamplingParams

MAX_STOP_STRINGS = 8
MAX_STOP_STRING_CHARS = 256
# Below this, dividing a logit by the penalty overflows float32 (inf, then NaN probabilities).
MIN_REPETITION_PENALTY = 1e-6


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Validated on construction; every error names the field, the value and the limit.

    Order of application (as vLLM and HF): penalties -> temperature -> top-k -> top-p -> min-p -> sample.
    temperature == 0 means greedy (argmax after penalties).
    """

    max_tokens: int | None = 16  # None: until EOS, a stop, or the model's context is full
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
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        def bad(name: str, value: object, limit: str) -> InvalidSamplingParams:
            return InvalidSamplingParams(f"{name} must be {limit}, got {value!r}", param=name)

        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, ">= 1")
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
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", list(self.stop_token_ids), "non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
