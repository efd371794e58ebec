"""The request body of POST /v1/responses: its input items, tools, text format and options.

What the platform cannot serve is refused by name (400) rather than dropped: image, file and audio
inputs (the served models read text), built-in tools (web search, file search, ...), and `background`.
"""

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    Tag,
    field_validator,
)

from app.schemas.extensions import MAX_TOKENS_BOUND, ResponsesClientDefaults, VllmSampling
from app.schemas.openai import (
    MAX_ARGUMENTS_CHARS,
    MAX_DESCRIPTION_CHARS,
    MAX_INPUT_ITEMS,
    MAX_TOOLS,
    FunctionDefinition,
    Id,
    ToolName,
    _bounded_schema,
    count_items,
)

MAX_METADATA_KEYS = 16  # as OpenAI
MAX_OUTPUT_CHARS = 1_000_000  # a function call's output sent back
MAX_ITEM_ID_CHARS = 64  # a client's item id, stored and listed, never rendered (OpenAI's ids have ~52)
UNSERVED_CONTENT = {"input_image": "image", "input_file": "file", "input_audio": "audio"}


def _metadata_keys(value: dict[str, str]) -> dict[str, str]:
    if any(len(key) > 64 for key in value):
        raise ValueError("metadata keys may have at most 64 characters")
    return value


# Up to 16 key-value pairs (keys up to 64 characters, values up to 512), as OpenAI; batches take it too.
Metadata = Annotated[
    dict[str, Annotated[str, Field(max_length=512)]],
    Field(max_length=MAX_METADATA_KEYS),
    AfterValidator(_metadata_keys),
]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")  # unknown fields: a 400 naming them


class InputText(_Request):
    type: Literal["input_text"]
    text: str


class OutputText(_Request):
    """An assistant's text, as this API returned it (sent back as input)."""

    type: Literal["output_text"]
    text: str
    # Accepted as the SDKs send them back, never rendered into a prompt: stored empty (conversation.with_ids).
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


ContentPart = Annotated[InputText | OutputText, Field(discriminator="type")]


def _served_parts(value: Any) -> Any:
    """Image, file and audio parts are refused by name, not as a failed union."""
    if isinstance(value, list):
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind in UNSERVED_CONTENT:
                raise ValueError(
                    f"{UNSERVED_CONTENT[kind]} inputs ({kind}) are not supported: the models served here "
                    "read text only"
                )
    return value


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = Field(default=None, max_length=MAX_ITEM_ID_CHARS)
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    _content = field_validator("content", mode="before")(_served_parts)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Request):
    """A call the model made earlier, sent back with its output."""

    type: Literal["function_call"]
    call_id: Id
    name: ToolName
    arguments: str = Field(max_length=MAX_ARGUMENTS_CHARS)
    id: str | None = Field(default=None, max_length=MAX_ITEM_ID_CHARS)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: Id
    output: str | list[InputText] = Field(description="What the function returned.")
    id: str | None = Field(default=None, max_length=MAX_ITEM_ID_CHARS)
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @field_validator("output")
    @classmethod
    def _bounded(cls, value: str | list[InputText]) -> str | list[InputText]:
        if len(value if isinstance(value, str) else "".join(p.text for p in value)) > MAX_OUTPUT_CHARS:
            raise ValueError(f"a function call's output may have at most {MAX_OUTPUT_CHARS:,} characters")
        return value

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(_Request):
    type: Literal["reasoning_text", "summary_text"]
    text: str = Field(max_length=MAX_OUTPUT_CHARS)


class ReasoningItem(_Request):
    """A reasoning item sent back (as this API or OpenAI returned it): accepted so that clients can replay
    their output whole, and left out of the prompt (no model here is trained to read past reasoning: Qwen3's
    template drops it from earlier turns too)."""

    type: Literal["reasoning"]
    id: str | None = Field(default=None, max_length=MAX_ITEM_ID_CHARS)
    summary: list[ReasoningText] = Field(default_factory=list, max_length=MAX_INPUT_ITEMS)
    content: list[ReasoningText] | None = Field(default=None, max_length=MAX_INPUT_ITEMS)
    encrypted_content: str | None = Field(default=None, max_length=MAX_OUTPUT_CHARS)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def item_type(value: Any) -> str | None:
    """A message may leave out its type (OpenAI's "easy" input message)."""
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(item_type),
]


class FunctionTool(FunctionDefinition):
    """Chat's function definition, flat: the Responses API puts `type` beside its fields."""

    type: Literal["function"]


class ToolChoiceFunction(_Request):
    type: Literal["function"]
    name: ToolName


class FormatText(_Request):
    type: Literal["text"]


class FormatJsonObject(_Request):
    type: Literal["json_object"]


class FormatJsonSchema(_Request):
    type: Literal["json_schema"]
    name: ToolName
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    schema_: dict[str, Any] | None = Field(
        default=None, alias="schema", description="A JSON Schema; absent: any JSON object."
    )
    strict: bool | None = None

    _schema = field_validator("schema_")(_bounded_schema)


TextFormat = Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")]


class TextConfig(_Request):
    format: TextFormat | None = None


# vLLM's extensions too, with their meaning on chat (GuideLLM sends ignore_eos here), and the fields the
# OpenAI SDK and the Agents SDK send on their own.
class ResponseRequest(VllmSampling, ResponsesClientDefaults, _Request):
    model: str = Field(min_length=1, max_length=256, description="A base model or one of your adapters.")
    input: str | list[InputItem] = Field(description="Text, or a list of messages and function call items.")
    instructions: str | None = Field(
        default=None, description="A system message for this request (not carried to continuations)."
    )
    max_output_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_BOUND)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    metadata: Metadata | None = Field(default=None, description="Up to 16 key-value pairs, returned as sent.")
    user: str | None = Field(default=None, max_length=256)
    store: StrictBool = Field(default=True, description="Keep the response for retrieval and continuation.")
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=64)
    truncation: Literal["auto", "disabled"] = Field(
        default="disabled",
        description="A conversation past the context: 'auto' drops its oldest turns, 'disabled' is a 400.",
    )
    stream: StrictBool = False
    background: StrictBool | None = None

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: str | list[Any]) -> str | list[Any]:
        if not value:
            raise ValueError("input must not be empty")
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value: Any) -> Any:
        """The count is checked first (before any item is); item types we do not serve are named (a failed
        union would list pydantic's tags instead)."""
        count_items("input", value, MAX_INPUT_ITEMS)
        if isinstance(value, list):
            for number, item in enumerate(value):
                kind = item_type(item)
                if kind not in ITEM_TYPES:
                    raise ValueError(
                        f"input[{number}] has type {str(kind)[:64]!r}; the items served are messages, "
                        "function_call, function_call_output and reasoning"
                    )
                if kind == "message" and isinstance(item, dict):
                    _served_parts(item.get("content"))  # named here: the union's errors would name `str`
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        if isinstance(value, list):
            for number, tool in enumerate(value):
                kind = tool.get("type") if isinstance(tool, dict) else None
                if kind != "function":
                    raise ValueError(
                        f"tools[{number}] is a {str(kind)[:64]} tool; only function tools are served "
                        "(no built-in tools such as web search)"
                    )
        return value

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, value: list[FunctionTool] | None) -> list[FunctionTool] | None:
        names = [t.name for t in value or ()]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        return value

    @field_validator("background")
    @classmethod
    def _foreground(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("background responses are not supported; send the request and wait for it")
        return value

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]:
        """The input as a list of items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)
