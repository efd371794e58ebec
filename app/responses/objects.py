"""The response object of the Responses API and its output items, as served, stored and streamed."""

import secrets
from typing import Any, Literal

from pydantic import BaseModel, Field

ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


def item_id(kind: str) -> str:
    """`msg_...` for messages, `fc_...` for function calls, `rs_...` for reasoning: ids of items within
    responses."""
    return f"{kind}_{secrets.token_hex(16)}"


class OutputTextPart(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class MessageOut(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputTextPart]


class FunctionCallOut(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # JSON text of an object
    status: ItemStatus


class ReasoningTextPart(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOut(BaseModel):
    """A thinking model's reasoning, as OpenAI shapes it for open models: the text whole in `content`;
    no summary is written (`summary` empty) and nothing is encrypted."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningTextPart]
    encrypted_content: str | None = None
    status: ItemStatus


OutputItem = ReasoningOut | MessageOut | FunctionCallOut


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    """Why a response is incomplete. A response stopped at its GPU-time bound is cut by a limit, as one cut
    by max_output_tokens is (chat's finish_reason "length"), and says `gpu_time_limited: true` as chat's
    choice does; the field is absent otherwise."""

    reason: Literal["max_output_tokens"]
    gpu_time_limited: bool | None = Field(default=None, exclude_if=lambda v: v is None)


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """Every field the Open Responses specification requires of a response object is present (null or its
    neutral value where the platform has nothing to say), so strict clients and validators accept it."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: ResponseStatus
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    temperature: float
    top_p: float
    tool_choice: Any
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    truncation: Literal["auto", "disabled"]
    usage: ResponseUsage | None = None
    user: str | None
    metadata: dict[str, str]
    store: bool
    background: bool = False
    # Sampling and service fields the served models do not use: their neutral values.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    service_tier: str = "default"
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
