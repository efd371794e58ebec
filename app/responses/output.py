"""OutputBuilder: a response's output items, built from the chat path's text and tool calls, with the
typed stream events that announce them, in the order OpenAI's SDK assembles (each item added, its content
streamed, then done), numbered by `sequence_number`.

A thinking model's reasoning item comes first (its text streamed as `response.reasoning_text.delta`); a
message item opens at the first text and closes when a function call starts or the output ends; each call
is one item whose arguments arrive in one delta (the tool-call parser releases a call whole).

The open item's text (or arguments) is collected as pieces and joined once when the item closes: appending
each delta with `+=` copied the text so far every time, quadratic in a long stream (issue 35). Nothing
reads an open item's text before it closes: the output items are read after `finish`.
"""

import json
from dataclasses import dataclass, field
from typing import Any

from app.responses.objects import (
    FunctionCallOut,
    ItemStatus,
    MessageOut,
    OutputItem,
    OutputTextPart,
    ReasoningOut,
    ReasoningTextPart,
    ResponseObject,
    item_id,
)


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event, named by its type as OpenAI names them."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


@dataclass
class OutputBuilder:
    items: list[OutputItem] = field(default_factory=list)
    sequence: int = 0
    _open: OutputItem | None = None  # the item being streamed
    _pieces: list[str] = field(default_factory=list)  # its text or arguments so far, joined when it closes
    _events: list[str] = field(default_factory=list)

    # -- events ---------------------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return sse(payload)

    def lifecycle(self, kind: str, response: ResponseObject) -> str:
        """response.created / in_progress / completed / incomplete / failed, with the whole response."""
        return self.event(kind, response=response.model_dump())

    def take(self) -> list[str]:
        events, self._events = self._events, []
        return events

    def _emit(self, kind: str, **fields: Any) -> None:
        self._events.append(self.event(kind, **fields))

    # -- building ---------------------------------------------------------------------------------------

    def text(self, delta: str) -> None:
        self._stream_text(MessageOut, delta)

    def reasoning(self, delta: str) -> None:
        """Reasoning text: a reasoning item (before the message), streamed as `reasoning_text` deltas."""
        self._stream_text(ReasoningOut, delta)

    def _stream_text(self, kind: type[MessageOut | ReasoningOut], delta: str) -> None:
        """A delta of the open item's text, opening an item of `kind` first unless one is open."""
        if not delta:
            return
        item = self._open
        if not isinstance(item, kind):
            if kind is MessageOut:
                item = MessageOut(id=item_id("msg"), status="in_progress", content=[OutputTextPart(text="")])
            else:
                item = ReasoningOut(
                    id=item_id("rs"), status="in_progress", content=[ReasoningTextPart(text="")]
                )
            self._open_with_part(item, item.content[0])
        if isinstance(item, MessageOut):
            self._delta("response.output_text.delta", item.id, delta, logprobs=[])
        else:
            self._delta("response.reasoning_text.delta", item.id, delta)

    def _open_with_part(
        self, item: MessageOut | ReasoningOut, part: OutputTextPart | ReasoningTextPart
    ) -> None:
        """A new item with one text part: the open one closed first; added, then its part added."""
        self._close()
        self._add(item)
        self._emit(
            "response.content_part.added",
            item_id=item.id,
            output_index=len(self.items) - 1,
            content_index=0,
            part=part.model_dump(),
        )

    def _delta(self, kind: str, item: str, delta: str, **more: object) -> None:
        self._pieces.append(delta)
        self._emit(kind, item_id=item, output_index=len(self.items) - 1, content_index=0, delta=delta, **more)

    def call(self, call_id: str, name: str, arguments: str) -> None:
        """A function call, whole: added, its arguments, done."""
        self.call_opens(call_id, name)
        self.call_arguments(arguments)
        self._close()

    def call_opens(self, call_id: str, name: str) -> None:
        self._close()
        self._add(
            FunctionCallOut(id=item_id("fc"), call_id=call_id, name=name, arguments="", status="in_progress")
        )

    def call_arguments(self, delta: str) -> None:
        call = self._open
        if not isinstance(call, FunctionCallOut) or not delta:
            return
        self._pieces.append(delta)
        self._emit(
            "response.function_call_arguments.delta",
            item_id=call.id,
            output_index=len(self.items) - 1,
            delta=delta,
        )

    def finish(self, status: ItemStatus = "completed") -> None:
        """The output ended: the open item is done (`incomplete` when the output was cut short)."""
        self._close(status)

    def _add(self, item: OutputItem) -> None:
        self.items.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=len(self.items) - 1, item=item.model_dump())

    def _close(self, status: ItemStatus = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        index = len(self.items) - 1
        joined, self._pieces = "".join(self._pieces), []
        if isinstance(item, MessageOut | ReasoningOut):
            part = item.content[0]
            part.text = joined
            message = isinstance(item, MessageOut)
            done = "output_text" if message else "reasoning_text"
            more: dict[str, Any] = {"logprobs": []} if message else {}
            common = {"item_id": item.id, "output_index": index, "content_index": 0}
            self._emit(f"response.{done}.done", **common, text=joined, **more)
            self._emit("response.content_part.done", **common, part=part.model_dump())
        else:
            item.arguments = joined
            self._emit(
                "response.function_call_arguments.done",
                item_id=item.id,
                output_index=index,
                name=item.name,
                arguments=item.arguments,
            )
        item.status = status
        self._emit("response.output_item.done", output_index=index, item=item.model_dump())
