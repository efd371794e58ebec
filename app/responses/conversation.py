"""Conversation: a Responses request's items (its chain's, then its own) as a chat completions request,
so templating, tools, structured output and limits are the chat path's own.

Items are kept as JSON (stored with the response); each gets an id when first seen. Function calls that
follow an assistant message join it as its tool calls; a function call's output is a tool message.
"""

import json
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from app.errors import InvalidParameter
from app.responses.objects import item_id
from app.responses.request import (
    FormatJsonObject,
    FormatJsonSchema,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ResponseRequest,
)
from app.schemas.extensions import VllmSampling
from app.schemas.openai import ChatCompletionRequest, ChatMessage, ToolCall

Item = MessageItem | FunctionCallItem | FunctionCallOutputItem
_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])
# Where the chat path's error names a chat field, the Responses API's name for it.
PARAMS = {
    "messages": "input",
    "response_format": "text.format",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
}


def with_ids(items: list[Item]) -> list[dict[str, Any]]:
    """The request's items as JSON, each with an id (its own if it came with one)."""
    out = []
    for item in items:
        value = item.model_dump(exclude_none=True, by_alias=True)
        value.setdefault("id", item_id("fc" if isinstance(item, FunctionCallItem) else "msg"))
        out.append(value)
    return out


def parse(items: list[dict[str, Any]]) -> list[Item]:
    return list(_ITEMS.validate_python(items))


def turns(items: list[dict[str, Any]]) -> list[int]:
    """Where each turn starts (a user message): dropping whole turns keeps calls beside their outputs."""
    return [
        n
        for n, item in enumerate(items)
        if item.get("type", "message") == "message" and item.get("role") == "user"
    ]


@dataclass(frozen=True)
class Conversation:
    context: list[dict[str, Any]]  # the chain's items, oldest first
    items: list[dict[str, Any]]  # this request's

    def size(self) -> int:
        """Characters of the conversation as JSON (what storing it takes)."""
        return len(json.dumps([*self.context, *self.items], separators=(",", ":"), ensure_ascii=False))

    def without_oldest_turn(self) -> "Conversation | None":
        """The conversation less its chain's oldest turn; None when the chain is empty."""
        if not self.context:
            return None
        starts = [n for n in turns(self.context) if n > 0]
        cut = starts[0] if starts else len(self.context)
        return Conversation(self.context[cut:], self.items)

    def messages(self, instructions: str | None) -> list[ChatMessage]:
        messages: list[ChatMessage] = []
        if instructions:
            messages.append(ChatMessage(role="system", content=instructions))
        for item in parse([*self.context, *self.items]):
            if isinstance(item, MessageItem):
                messages.append(ChatMessage(role=item.role, content=item.text()))
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last.role == "assistant":
                    last.tool_calls = [*(last.tool_calls or []), *_calls([call])]
                else:
                    messages.append(ChatMessage(role="assistant", content=None, tool_calls=_calls([call])))
            else:
                messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.text()))
        return messages

    def chat_request(self, body: ResponseRequest) -> ChatCompletionRequest:
        """The chat request this response runs as; its checks' errors name the Responses fields."""
        fields: dict[str, Any] = {
            "model": body.model,
            "messages": self.messages(body.instructions),
            "max_completion_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "parallel_tool_calls": body.parallel_tool_calls,
            "user": body.user,
            "stream": body.stream,
            **body.model_dump(include=set(VllmSampling.model_fields), exclude_unset=True),
        }
        if body.tools:
            fields["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in body.tools
            ]
        choice = body.tool_choice
        if choice is not None:
            fields["tool_choice"] = (
                choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
            )
        fmt = body.text.format if body.text is not None else None
        if body.tools and choice is not None and choice not in ("none", "auto"):
            # A forced call's output is the call, never text, so the text format has nothing to shape in
            # this turn (the Agents SDK sends both: an output type and a tool_choice it resets after a call).
            fmt = None
        if isinstance(fmt, FormatJsonObject):
            fields["response_format"] = {"type": "json_object"}
        elif isinstance(fmt, FormatJsonSchema):
            schema = fmt.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as error:
            first = error.errors()[0]
            loc = [str(p) for p in first.get("loc", ())]
            param = PARAMS.get(loc[0], loc[0]) if loc else None
            raise InvalidParameter(f"{param}: {first.get('msg', 'invalid value')}", param=param) from None


def _calls(calls: list[dict[str, Any]]) -> list[ToolCall]:
    return [ToolCall.model_validate(c) for c in calls]
