"""OpenAI-compatible request and response bodies (the subset we serve; unknown fields are refused)."""

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationInfo, field_validator

from deployments.engine.interface import MIN_REPETITION_PENALTY  # the sampler's float32 floor

MAX_STOP = 4  # as OpenAI
# Bounds that no served model reaches: a number past them is a mistake, refused by name before it can
# reach the limiter or the engine (the model's own context bounds max_tokens further, per request).
MAX_TOKENS_BOUND = 1 << 20
MAX_TOP_K = 1 << 20
StopString = Annotated[str, Field(max_length=1024)]  # echoed back in errors and logs: bounded


class _Request(BaseModel):
    # Unknown fields get a 400 naming them (as OpenAI does), instead of being silently ignored.
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = Field(default=False, description="Send a final chunk with usage and no choices.")


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] = Field(description="Text, or a list of text parts.")
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class SamplingFields(_Request):
    """Fields shared by both endpoints; vLLM's extensions top_k, min_p and repetition_penalty included."""

    model: str = Field(min_length=1, max_length=256, description="A base model or one of your adapters.")
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_BOUND)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_TOP_K)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(ge=MIN_REPETITION_PENALTY, le=10)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: StopString | list[StopString] | None = None
    n: Annotated[int, Field(ge=1, le=1, description="Only one choice per request is served.")] = 1
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


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_BOUND)] | None = None

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(description="Text, or token ids.")
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_BOUND)] | None = (
        None  # absent: 16 (OpenAI's default), within the cap
    )
    echo: Literal[False] = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str | list[int]) -> str | list[int]:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        return value

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens


# -- responses --------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


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
    logprobs: None = None


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
