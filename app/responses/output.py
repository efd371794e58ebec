"""OutputBuilder: a response's output items, built from the chat path's text and tool calls, with the
typed stream events that announce them, in the order OpenAI's SDK assembles (each item added, its content
streamed, then done), numbered by `sequence_number`.

A message item opens at the first text and closes when a function call starts or the output ends; each
call is one item whose arguments arrive in one delta (the tool-call parser releases a call whole).
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
        if not delta:
            return
        message = self._open
        if not isinstance(message, MessageOut):
            self._close()
            message = MessageOut(id=item_id("msg"), status="in_progress", content=[])
            self._add(message)
            part = OutputTextPart(text="")
            message.content.append(part)
            self._emit(
                "response.content_part.added",
                item_id=message.id,
                output_index=len(self.items) - 1,
                content_index=0,
                part=part.model_dump(),
            )
        message.content[0].text += delta
        self._emit(
            "response.output_text.delta",
            item_id=message.id,
            output_index=len(self.items) - 1,
            content_index=0,
            delta=delta,
            logprobs=[],
        )

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
        call.arguments += delta
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
        if isinstance(item, MessageOut):
            part = item.content[0]
            self._emit(
                "response.output_text.done",
                item_id=item.id,
                output_index=index,
                content_index=0,
                text=part.text,
                logprobs=[],
            )
            self._emit(
                "response.content_part.done",
                item_id=item.id,
                output_index=index,
                content_index=0,
                part=part.model_dump(),
            )
        else:
            self._emit(
                "response.function_call_arguments.done",
                item_id=item.id,
                output_index=index,
                name=item.name,
                arguments=item.arguments,
            )
        item.status = status
        self._emit("response.output_item.done", output_index=index, item=item.model_dump())
