"""Conversation: a Responses request's items (its chain's, then its own) as a chat completions request,
so templating, tools, structured output and limits are the chat path's own.

Items are kept as JSON (stored with the response); each gets an id when first seen. Function calls that
follow an assistant message join it as its tool calls; a function call's output is a tool message; a
reasoning item is kept but renders nothing (as Qwen3's own template drops past turns' thinking).
"""

import json
from collections.abc import Callable
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
    ReasoningItem,
    ResponseRequest,
)
from app.schemas.extensions import VllmSampling
from app.schemas.openai import ChatCompletionRequest, ChatMessage, ToolCall

Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])
# Where the chat path's error names a chat field, the Responses API's name for it.
PARAMS = {
    "messages": "input",
    "response_format": "text.format",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "reasoning_effort": "reasoning.effort",
}


def with_ids(items: list[Item]) -> list[dict[str, Any]]:
    """The request's items as JSON, each with an id (its own if it came with one). What no prompt renders is
    not kept: an output_text part's annotations and logprobs are stored empty (issue 35: a 3-character
    prompt with megabytes of annotations stored them all, at the price of a few tokens)."""
    out = []
    for item in items:
        value = item.model_dump(exclude_none=True, by_alias=True)
        content = value.get("content")
        for part in content if isinstance(content, list) else ():
            for unrendered in ("annotations", "logprobs"):
                if unrendered in part:
                    part[unrendered] = []
        kind = (
            "fc" if isinstance(item, FunctionCallItem) else "rs" if isinstance(item, ReasoningItem) else "msg"
        )
        value.setdefault("id", item_id(kind))
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

    def cuts(self) -> list[int]:
        """Where the chain may be cut, oldest first: each later turn's start, then its end (all dropped)."""
        return [*(n for n in turns(self.context) if n > 0), len(self.context)]

    def from_cut(self, cut: int) -> "Conversation":
        """The conversation less its chain's items before `cut` (one of cuts())."""
        return Conversation(self.context[cut:], self.items)

    def without_oldest_turn(self) -> "Conversation | None":
        """The conversation less its chain's oldest turn; None when the chain is empty."""
        if not self.context:
            return None
        return self.from_cut(self.cuts()[0])

    def cut_to_size(self, limit: int, drop: bool = True) -> "Conversation | None":
        """The conversation less as few of its chain's oldest turns as bring its JSON within `limit`
        characters (none unless `drop`); None when even all of them are not enough. Each item is
        serialised once and the cut found by arithmetic: a list's compact JSON is its items' joined by
        commas, in brackets."""
        sizes = [_json_size(item) for item in self.context]
        size = (
            2 + sum(sizes) + sum(_json_size(item) for item in self.items) + len(sizes) + len(self.items) - 1
        )
        done = 0
        for cut in [0, *self.cuts()] if drop else [0]:
            size -= sum(sizes[done:cut]) + cut - done  # each dropped item and its comma
            done = cut
            if size <= limit:
                return self if cut == 0 else self.from_cut(cut)
        return None

    def cut_to_tokens(
        self, tokens: int, excess: int, own: int | None, count: Callable[[list[str]], list[int]]
    ) -> int:
        """Where to cut the chain so that a prompt of `tokens` loses `excess` of them, found by arithmetic:
        each chain item's text is counted once (`count`: tokens per text), and the chain's template
        overhead (`tokens` less `own`, the prompt without the chain, less the chain's text) is spread over
        its items. Without `own` all the overhead is spread: the cut errs short, and the caller drops one
        more turn if it must. len(context) when even the whole chain is not enough."""
        counts = count([item_text(item) for item in self.context])
        chain = tokens - (own if own is not None else 0)
        overhead = max(chain - sum(counts), 0) / max(len(counts), 1)
        dropped = 0.0
        done = 0
        for cut in self.cuts():
            dropped += sum(counts[done:cut]) + overhead * (cut - done)
            done = cut
            if dropped >= excess:
                return cut
        return len(self.context)

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
            elif isinstance(item, FunctionCallOutputItem):
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
        if body.reasoning is not None and body.reasoning.effort is not None:
            fields["reasoning_effort"] = body.reasoning.effort
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


def _json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))


def item_text(item: dict[str, Any]) -> str:
    """What of a stored item the template renders as text (its role and call id are template overhead)."""
    kind = item.get("type", "message")
    if kind == "reasoning":  # never rendered
        return ""
    if kind == "function_call":
        return f"{item.get('name', '')}{item.get('arguments', '')}"
    value = item.get("output") if kind == "function_call_output" else item.get("content")
    if isinstance(value, list):
        return "".join(str(part.get("text", "")) for part in value if isinstance(part, dict))
    return value if isinstance(value, str) else ""


def _calls(calls: list[dict[str, Any]]) -> list[ToolCall]:
    return [ToolCall.model_validate(c) for c in calls]
