"""Request fields beyond OpenAI's own that every generating endpoint (chat, completions, responses) takes.

`VllmSampling`: vLLM's sampling extensions, which load tools (GuideLLM, AIPerf) and vLLM clients send;
each is honoured by the engine, none is dropped. `ClientDefaults`: fields the OpenAI SDKs and the Agents
SDK send on their own, which change nothing here and are accepted so those clients work unchanged (each
says why it is a no-op). Anything else stays a 400 naming it (the endpoints' models forbid extra fields).

Bounds that need the served model (the vocabulary) or the request's output limit are checked by
`sampling_extensions`, which turns the fields into the engine's SamplingParams arguments: one place for
every endpoint, so the Responses API reads them exactly as chat does.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from app.errors import InvalidParameter
from deployments.engine.interface import MAX_STOP_TOKEN_IDS, MIN_REPETITION_PENALTY

# Bounds that no served model reaches: a number past them is a mistake, refused by name before it can
# reach the limiter or the engine (the model's own context bounds max_tokens further, per request).
MAX_TOKENS_BOUND = 1 << 20
MAX_TOP_K = 1 << 20
MAX_METADATA = 16  # entries, as OpenAI
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]  # checked against the model's vocabulary per request
ShortText = Annotated[str, Field(max_length=256)]
Metadata = dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]]


class VllmSampling(BaseModel):
    """vLLM's extensions to OpenAI's sampling fields, with vLLM's meaning."""

    model_config = ConfigDict(extra="forbid")

    top_k: Annotated[int, Field(ge=0, le=MAX_TOP_K)] | None = Field(
        default=None, description="Sample among the k likeliest tokens only; 0 or absent: all."
    )
    min_p: Annotated[float, Field(ge=0, le=1)] | None = Field(
        default=None, description="Drop tokens less likely than min_p times the likeliest one."
    )
    repetition_penalty: Annotated[float, Field(ge=MIN_REPETITION_PENALTY, le=10)] | None = Field(
        default=None, description="CTRL-style penalty on tokens of the prompt and the output; 1: none."
    )
    ignore_eos: StrictBool = Field(
        default=False,
        description="Keep generating past the end-of-sequence token, to max_tokens (fixed output lengths "
        "for benchmarks). Not with structured output, whose grammar ends with EOS.",
    )
    min_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_BOUND)] = Field(
        default=0,
        description="Generate at least this many tokens before EOS, a stop token id or a stop string may "
        "end the output (stop strings are looked for only in the text after them). At most max_tokens.",
    )
    stop_token_ids: list[TokenId] | None = Field(
        default=None,
        max_length=MAX_STOP_TOKEN_IDS,
        description="Token ids that end the output like EOS (the id is not part of the text).",
    )
    skip_special_tokens: StrictBool = Field(
        default=True, description="Leave special tokens (such as EOS) out of the returned text."
    )


class ClientDefaults(BaseModel):
    """Fields OpenAI's SDKs send by default or on a setting's behalf; accepted and, here, without effect."""

    model_config = ConfigDict(extra="forbid")

    service_tier: Literal["auto", "default", "flex", "priority"] | None = Field(
        default=None, description="No-op: one service tier; a tenant's limits come from its own tier."
    )
    prompt_cache_key: ShortText | None = Field(
        default=None,
        description="No-op: prompt prefixes are cached and reused per tenant without a key.",
    )
    prompt_cache_retention: Literal["in-memory", "24h"] | None = Field(
        default=None, description="No-op: cached prefixes live in the engine's memory while it has room."
    )
    safety_identifier: ShortText | None = Field(
        default=None, description="No-op: accepted for the client's benefit, not stored."
    )


# OpenAI's reasoning efforts. A thinking model (its chat template renders thinking) thinks for any but
# "none"; our models have no effort scale, so the others all mean "think". Models without thinking refuse
# all but "none" (app/completions/reasoning.py: thinking_switch).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class ChatTemplateKwargs(BaseModel):
    """vLLM's `chat_template_kwargs`, as far as they are served: only `enable_thinking` (any other key would
    reach the template unchecked, so it is a 400 naming it)."""

    model_config = ConfigDict(extra="forbid")

    enable_thinking: StrictBool | None = Field(
        default=None,
        description="Qwen3's switch: false renders the prompt without thinking; true (the template's own "
        "default) lets the model think. Only for models whose chat template thinks.",
    )


class ChatClientDefaults(ClientDefaults):
    """What chat clients add: `store` and `metadata` (kept by OpenAI for its dashboards) and a reasoning
    effort, honoured by thinking models as on/off (refused by the others unless "none")."""

    store: StrictBool | None = Field(default=None, description="No-op: chat completions are never stored.")
    metadata: Metadata | None = Field(
        default=None, max_length=MAX_METADATA, description="No-op: accepted, not stored (16 entries at most)."
    )
    reasoning_effort: ReasoningEffort | None = Field(
        default=None,
        description="For a thinking model: 'none' turns thinking off, any other effort on (there is no "
        "scale between). Other models refuse all but 'none'.",
    )
    modalities: list[Literal["text"]] | None = Field(
        default=None, max_length=1, description="Only ['text']: the served models produce text."
    )


# What `include` may ask for; each names an item the platform never produces (no built-in tools, image
# inputs, or encrypted reasoning: reasoning text is returned as is), so asking is a no-op. Logprobs would be
# a silent drop, so they are refused.
Includable = Literal[
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
]
MAX_INCLUDE = 16


SummaryMode = Literal["auto", "concise", "detailed"]


class Reasoning(BaseModel):
    """The Responses API's reasoning setting: `effort` as chat's reasoning_effort. A thinking model's
    reasoning item carries its reasoning text whole (`content`); no summary is written (`summary` stays
    empty), so asking for one is accepted and changes nothing. Models without thinking refuse effort and
    summary but "none"/null."""

    model_config = ConfigDict(extra="forbid")

    effort: ReasoningEffort | None = None
    summary: SummaryMode | None = None
    generate_summary: SummaryMode | None = None  # deprecated spelling of summary


class ResponsesClientDefaults(ClientDefaults):
    """What Responses clients add: the Agents SDK sends `include` (empty) on every call, and passes
    `top_logprobs` and `reasoning` from its model settings."""

    include: list[Includable] | None = Field(
        default=None,
        max_length=MAX_INCLUDE,
        description="No-op for what is never produced here (built-in tool results, images, reasoning); "
        "'message.output_text.logprobs' is refused (logprobs are served on chat completions).",
    )
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = Field(
        default=None, description="No-op: logprobs are returned only when included, which is refused."
    )
    reasoning: Reasoning | None = Field(
        default=None, description="Thinking on or off for a thinking model (effort); see Reasoning."
    )

    @field_validator("include")
    @classmethod
    def _no_logprobs(cls, value: list[str] | None) -> list[str] | None:
        if value and "message.output_text.logprobs" in value:
            raise ValueError(
                "message.output_text.logprobs is not served on /v1/responses; chat completions return "
                "logprobs"
            )
        return value


def sampling_extensions(
    fields: VllmSampling, *, vocab_size: int, max_tokens: int | None, structured: bool
) -> dict[str, Any]:
    """The engine's SamplingParams arguments for these fields, checked against this request's model and
    output limit; every refusal names its field (a 400 before anything is queued)."""
    stop_ids = tuple(fields.stop_token_ids or ())
    bad = [t for t in stop_ids if t >= vocab_size]
    if bad:
        message = f"stop_token_ids must be token ids from 0 to {vocab_size - 1}; got {bad[0]}"
        raise InvalidParameter(message, param="stop_token_ids")
    if max_tokens is not None and fields.min_tokens > max_tokens:
        message = f"min_tokens ({fields.min_tokens}) must not exceed max_tokens ({max_tokens})"
        raise InvalidParameter(message, param="min_tokens")
    if structured and (fields.ignore_eos or fields.min_tokens):
        param = "ignore_eos" if fields.ignore_eos else "min_tokens"
        message = f"{param} cannot be used with structured output or tools: the grammar ends the output"
        raise InvalidParameter(message, param=param)
    return {
        "top_k": fields.top_k or 0,
        "min_p": fields.min_p or 0.0,
        "repetition_penalty": fields.repetition_penalty or 1.0,
        "ignore_eos": fields.ignore_eos,
        "min_tokens": fields.min_tokens,
        "stop_token_ids": stop_ids,
        "skip_special_tokens": fields.skip_special_tokens,
    }
