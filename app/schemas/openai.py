"""OpenAI-compatible request and response bodies (the subset we serve; unknown fields are refused)."""

import json
import time
from typing import Annotated, Any, Literal, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    Tag,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from app.schemas.extensions import (
    MAX_TOKENS_BOUND,
    ChatClientDefaults,
    ChatTemplateKwargs,
    ClientDefaults,
    VllmSampling,
)
from deployments.engine.interface import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N

MAX_STOP = 4  # as OpenAI
MAX_TOOLS = 128  # as OpenAI
MAX_SCHEMA_CHARS = 32_768  # one JSON Schema (response_format's, or a tool's parameters) as compact JSON
MAX_TOOLS_SCHEMA_CHARS = 131_072  # all tools' definitions together, as compact JSON
MAX_DESCRIPTION_CHARS = 4096
MAX_ARGUMENTS_CHARS = 100_000  # a past tool call's arguments, sent back in an assistant message
MAX_COMPLETIONS_LOGPROBS = 5  # as OpenAI's /v1/completions
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # function and json_schema names, as OpenAI
ToolName = Annotated[str, Field(pattern=NAME_PATTERN)]
Id = Annotated[str, Field(min_length=1, max_length=256)]
MAX_PROMPT_TOKENS = MAX_TOKENS_BOUND  # token ids in one prompt (the model's context refuses fewer)
MAX_PROMPTS = 4096  # prompts in one /v1/completions list (Settings.max_prompts, 64 by default, allows fewer)
MAX_MESSAGES = 4096  # chat messages in one request (Settings.max_messages, 1024 by default, allows fewer)
MAX_INPUT_ITEMS = 4096  # items in one /v1/responses input (Settings.responses.max_input_items allows fewer)
StopString = Annotated[str, Field(max_length=1024)]  # echoed back in errors and logs: bounded


class _Request(BaseModel):
    # Unknown fields get a 400 naming them (as OpenAI does), instead of being silently ignored.
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = Field(default=False, description="Send a final chunk with usage and no choices.")
    continuous_usage_stats: bool = Field(
        default=False,
        description="vLLM's extension: every chunk carries the usage so far (with or without include_usage).",
    )


class TextPart(_Request):
    type: Literal["text"]
    text: str


def count_items(param: str, value: Any, bound: int) -> Any:
    """A list's length checked before any of its items is validated: a list past the schema's bound is
    refused at the cost of len(), one error naming the field (validating 63k messages took 0.55 s)."""
    if isinstance(value, list | tuple) and len(value) > bound:
        raise ValueError(f"{param} has {len(value):,} items; at most {bound:,} are accepted")
    return value


def _compact(schema: Any) -> str:
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _bounded_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    if schema is not None and len(_compact(schema)) > MAX_SCHEMA_CHARS:
        raise ValueError(f"a JSON schema may have at most {MAX_SCHEMA_CHARS:,} characters as compact JSON")
    return schema


class FunctionCall(_Request):
    name: ToolName
    arguments: str = Field(max_length=MAX_ARGUMENTS_CHARS, description="The call's arguments, as JSON.")


class ToolCall(_Request):
    """A call the assistant made earlier in the conversation."""

    id: Id
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(
        default=None, description="Text, or a list of text parts; null only for an assistant's tool calls."
    )
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(
        default=None, max_length=MAX_TOOLS, description="An assistant's calls (role assistant only)."
    )
    tool_call_id: Id | None = Field(default=None, description="The call a tool message answers.")
    reasoning_content: str | None = Field(
        default=None,
        description="An assistant's reasoning as a thinking model returned it, sent back (vLLM's field): "
        "accepted and not rendered, as Qwen3's template drops past turns' thinking.",
    )

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls_of_assistants(
        cls, value: list[ToolCall] | None, info: ValidationInfo
    ) -> list[ToolCall] | None:
        if value and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages may have tool_calls")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id_of_tools(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("role") != "tool":
            raise ValueError("only tool messages have a tool_call_id")
        return value

    @model_validator(mode="after")
    def _content_or_calls(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (null only for an assistant message with tool_calls)")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def size(self) -> int:
        """Characters this message puts into the prompt (its text and its calls' arguments)."""
        calls = sum(len(c.function.arguments) + len(c.function.name) for c in self.tool_calls or ())
        return len(self.text()) + calls


class ResponseFormatText(_Request):
    type: Literal["text"]


class ResponseFormatJsonObject(_Request):
    type: Literal["json_object"]


class JsonSchemaFormat(_Request):
    name: ToolName
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    schema_: dict[str, Any] | None = Field(
        default=None, alias="schema", description="A JSON Schema; absent: any JSON object."
    )
    strict: bool | None = None

    _schema = field_validator("schema_")(_bounded_schema)


class ResponseFormatJsonSchema(_Request):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema, Field(discriminator="type")
]


class FunctionDefinition(_Request):
    name: ToolName
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = Field(
        default=None, description="A JSON Schema of the arguments object; absent: no arguments."
    )
    strict: bool | None = None

    _parameters = field_validator("parameters")(_bounded_schema)


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Request):
    name: ToolName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: ToolChoiceFunction


class SamplingFields(VllmSampling, ClientDefaults, _Request):
    """Fields shared by both endpoints; vLLM's extensions (app/schemas/extensions.py) included."""

    model: str = Field(min_length=1, max_length=256, description="A base model or one of your adapters.")
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_BOUND)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: StopString | list[StopString] | None = None
    n: Annotated[
        int, Field(ge=1, le=MAX_N, description="Choices per prompt; the deployment may allow fewer.")
    ] = 1
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        default=None,
        max_length=MAX_LOGIT_BIAS,
        description="Token id (as a string) -> bias added to its logit before sampling, -100 to 100.",
    )
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return value

    @property
    def stop_list(self) -> list[str]:
        return self.stop if isinstance(self.stop, list) else []


class ChatCompletionRequest(SamplingFields, ChatClientDefaults):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_BOUND)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = Field(
        default=None, description="vLLM's: arguments for the chat template (enable_thinking only)."
    )

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[Tool] | None) -> list[Tool] | None:
        if not value:
            return value
        names = [t.function.name for t in value]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        size = len(_compact([t.model_dump(exclude_none=True) for t in value]))
        if size > MAX_TOOLS_SCHEMA_CHARS:
            raise ValueError(
                f"the tools have {size:,} characters as JSON; at most {MAX_TOOLS_SCHEMA_CHARS:,}"
            )
        return value

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_counted_first(cls, value: Any) -> Any:
        return count_items("messages", value, MAX_MESSAGES)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs is only allowed when logprobs is true")
        return value

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


PromptShape = Literal["text", "texts", "tokens", "token_lists"]


def prompt_shape(value: Any) -> PromptShape | None:
    """Which shape a prompt has, read from its first element: the prompt is then validated as that shape
    alone (a plain union tried list[str] on every token id first, ~1 s for a 2 MB list of ids)."""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list | tuple):
        return None
    first = value[0] if value else None
    if isinstance(first, str):
        return "texts"
    return "token_lists" if isinstance(first, list | tuple) else "tokens"


TokenIds = Annotated[list[int], Field(max_length=MAX_PROMPT_TOKENS)]  # checked by the engine, by vocabulary
Prompt = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[str], Field(max_length=MAX_PROMPTS), Tag("texts")]
    | Annotated[TokenIds, Tag("tokens")]
    | Annotated[list[TokenIds], Field(max_length=MAX_PROMPTS), Tag("token_lists")],
    Discriminator(prompt_shape),
]


def _check_prompt_lengths(value: Any) -> None:
    """The schema's list bounds, checked before any element is: a clear error, and no work spent on a
    list that is refused anyway."""
    shape = prompt_shape(value)
    if shape in ("texts", "token_lists") and len(value) > MAX_PROMPTS:
        raise ValueError(f"prompt is a list of {len(value):,} prompts; at most {MAX_PROMPTS:,} are accepted")
    prompts = value if shape == "token_lists" else [value] if shape == "tokens" else []
    for number, ids in enumerate(prompts):
        if isinstance(ids, list | tuple) and len(ids) > MAX_PROMPT_TOKENS:
            which = f"prompt {number}" if shape == "token_lists" else "the prompt"
            raise ValueError(
                f"{which} has {len(ids):,} token ids; at most {MAX_PROMPT_TOKENS:,} are accepted"
            )


class CompletionRequest(SamplingFields):
    prompt: Prompt = Field(description="Text, token ids, or a list of either (several prompts).")
    # absent: 16 (OpenAI's default), within the cap; 0 only with echo (the prompt's logprobs alone)
    max_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_BOUND)] | None = None
    echo: StrictBool = Field(default=False, description="Return the prompt before the completion.")
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETIONS_LOGPROBS)] | None = Field(
        default=None, description="Log-probabilities of each token and of this many likeliest ones."
    )
    response_format: ResponseFormat | None = Field(
        default=None, description="As chat's (not OpenAI's for completions; vLLM has it): JSON output."
    )

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_of_the_shapes(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Prompt:
        """One error naming `prompt` (not one per shape of the union, named after pydantic's types)."""
        _check_prompt_lengths(value)
        try:
            prompt: Prompt = handler(value)
        except ValidationError:
            raise ValueError(
                "prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                "token ids"
            ) from None
        return prompt

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Prompt) -> Prompt:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        if prompt_shape(value) in ("texts", "token_lists") and not all(value):
            raise ValueError("no prompt in the list may be empty")
        return value

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a list of prompts: texts or token id lists (as validated: nothing is copied)."""
        p = self.prompt
        shape = prompt_shape(p)
        if isinstance(p, str):
            return [p]
        if shape == "texts":
            return cast(list[str], p)
        if shape == "tokens":
            return [cast(list[int], p)]
        return cast(list[list[int]], p)

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens


# -- responses --------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # Present for thinking models: the completion's tokens up to the end of its reasoning.
    completion_tokens_details: CompletionTokensDetails | None = Field(
        default=None, exclude_if=lambda v: v is None
    )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # vLLM's field for a thinking model's reasoning; absent for other models.
    reasoning_content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    tool_calls: list[ToolCallOut] | None = None
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    # Not OpenAI's: present (true) when max_tokens ran low and the grammar steered the structured output to
    # its shortest completion; the output is complete and valid, its free parts maybe cut short.
    closing_forced: bool | None = Field(default=None, exclude_if=lambda v: v is None)
    # Not OpenAI's: present (true) with finish_reason "length" when the request reached its GPU-time bound
    # (a budgeted tenant whose prices charge GPU time: budget_max_gpu_seconds), not its max_tokens.
    gpu_time_limited: bool | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A piece of one tool call in a stream: the first names it (id, type, name), later ones add to its
    arguments (index and function.arguments only); the OpenAI SDK joins them by index."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    # Not OpenAI's: present (true) when max_tokens ran low and the grammar steered the structured output to
    # its shortest completion; the output is complete and valid, its free parts maybe cut short.
    closing_forced: bool | None = Field(default=None, exclude_if=lambda v: v is None)
    # Not OpenAI's: present (true) with finish_reason "length" when the request reached its GPU-time bound
    # (a budgeted tenant whose prices charge GPU time: budget_max_gpu_seconds), not its max_tokens.
    gpu_time_limited: bool | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    # Not OpenAI's: present (true) when max_tokens ran low and the grammar steered the structured output to
    # its shortest completion; the output is complete and valid, its free parts maybe cut short.
    closing_forced: bool | None = Field(default=None, exclude_if=lambda v: v is None)
    # Not OpenAI's: present (true) with finish_reason "length" when the request reached its GPU-time bound
    # (a budgeted tenant whose prices charge GPU time: budget_max_gpu_seconds), not its max_tokens.
    gpu_time_limited: bool | None = Field(default=None, exclude_if=lambda v: v is None)


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str = Field(description="The base model this model runs on.")
    parent: str | None = Field(default=None, description="For an adapter, its base model.")
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
