"""ResponsesRenderer: a response's engine outputs as a response object, or the Responses API's typed
event stream, straight from the engine's text (the tool-call parser releases each call whole); and the
response stored once it has ended (completed, or incomplete on length).

If the database fails at that point the client still gets its response, with `store: false` saying that
it was not kept (and the failure logged): it was served and billed.
"""

import logging
import time
from typing import Any

from starlette.concurrency import run_in_threadpool

from app.completions.rendering import HEAVY_BLOCKS, HEAVY_CHARS, finish_reason
from app.completions.tool_calls import BEGIN, ParsedCall, ToolCallStream, parse
from app.errors import to_api_error
from app.responses.conversation import Conversation
from app.responses.objects import (
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    ResponseError,
    ResponseObject,
    ResponseUsage,
)
from app.responses.output import OutputBuilder
from app.responses.store import ResponseStore
from deployments.engine.interface import RequestOutput

log = logging.getLogger(__name__)


class ResponsesRenderer:
    def __init__(
        self,
        response: ResponseObject,
        tool_names: frozenset[str],
        *,
        tenant_id: str,
        conversation: Conversation,
        store: ResponseStore,
    ) -> None:
        self.response = response  # as created: in progress, no output yet
        self.tool_names = tool_names
        self.tenant_id = tenant_id
        self.conversation = conversation  # what is stored with it
        self.store = store
        self.reset()

    def reset(self) -> None:
        self._builder = OutputBuilder()
        self._text: list[str] = []
        self._chars = 0
        self._tools = ToolCallStream(self.tool_names) if self.tool_names else None
        self._calls = 0
        self._finish: str | None = None

    def heavy(self, out: RequestOutput | None = None) -> bool:
        if out is None:
            return self._chars >= HEAVY_CHARS or self._openings("".join(self._text)) >= HEAVY_BLOCKS
        chars = len(out.text)
        tools = self._tools
        if tools is not None and (out.finish_reason is not None or out.finished or tools.closes(out.text)):
            chars += tools.held
        return chars >= HEAVY_CHARS or self._openings(out.text) >= HEAVY_BLOCKS

    def _openings(self, text: str) -> int:
        return text.count(BEGIN) if self.tool_names else 0

    # -- whole responses ----------------------------------------------------------------------------

    def add(self, out: RequestOutput) -> None:
        self._text.append(out.text)
        self._chars += len(out.text)
        if out.finish_reason is not None:
            self._finish = finish_reason(out)

    def body(self, last: RequestOutput) -> dict[str, Any]:
        text = "".join(self._text)
        content: str | None = text
        calls: list[ParsedCall] = []
        if self.tool_names:
            content, calls = parse(text, self.tool_names)
        builder = OutputBuilder()
        if content:
            builder.text(content)
        for call in calls:
            builder.call(call.id, call.name, call.arguments)
        incomplete = self._finish == "length" and not calls
        builder.finish("incomplete" if incomplete else "completed")
        return self._ended(builder.items, last, incomplete)

    async def keep(self, body: dict[str, Any]) -> dict[str, Any]:
        """Stored if the request asked to; marked `store: false` when it asked and the database failed."""
        if not body["store"]:
            return body
        try:
            await run_in_threadpool(
                self.store.save, self.tenant_id, body, self.conversation.context, self.conversation.items
            )
        except Exception:  # the response was served and billed: the client gets it, marked unstored
            log.exception("storing response %s failed", body["id"])
            return {**body, "store": False}
        return body

    def _ended(self, items: list[OutputItem], last: RequestOutput, incomplete: bool) -> dict[str, Any]:
        usage = last.usage
        update: dict[str, Any] = {
            "status": "incomplete" if incomplete else "completed",
            "completed_at": None if incomplete else int(time.time()),
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if incomplete else None,
            "output": items,
        }
        if usage is not None:
            update["usage"] = ResponseUsage(
                input_tokens=usage.prompt_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_prompt_tokens),
                output_tokens=usage.completion_tokens,
                total_tokens=usage.prompt_tokens + usage.completion_tokens,
            )
        return self.response.model_copy(update=update).model_dump()

    # -- streams --------------------------------------------------------------------------------------

    def opening(self, first: RequestOutput) -> list[str]:
        return [
            self._builder.lifecycle("response.created", self.response),
            self._builder.lifecycle("response.in_progress", self.response),
        ]

    def events(self, out: RequestOutput) -> list[str]:
        builder, tools = self._builder, self._tools
        ended = out.finish_reason is not None
        if tools is None:
            builder.text(out.text)
        else:
            for piece in tools.feed(out.text) + (tools.finish() if ended else []):
                if isinstance(piece, str):
                    builder.text(piece)
                else:
                    self._calls += 1
                    builder.call_opens(piece.id, piece.name)
                    builder.call_arguments(piece.arguments)
        if ended:
            self._finish = finish_reason(out)
        return builder.take()

    async def closing(self, last: RequestOutput) -> list[str]:
        builder = self._builder
        incomplete = self._finish == "length" and not self._calls
        builder.finish("incomplete" if incomplete else "completed")
        events = builder.take()
        body = await self.keep(self._ended(builder.items, last, incomplete))
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        events.append(builder.event(kind, response=body))
        return events

    def failure(self, error: Exception) -> list[str]:
        """An `error` event in OpenAI's shape, then `response.failed` with what was output so far."""
        builder = self._builder
        api_error = to_api_error(error)
        builder.finish("incomplete")
        events = builder.take()
        events.append(
            builder.event("error", code=api_error.code, message=api_error.message, param=api_error.param)
        )
        failed = self.response.model_copy(
            update={
                "status": "failed",
                "error": ResponseError(code=api_error.code or "server_error", message=api_error.message),
                "output": builder.items,
            }
        )
        events.append(builder.lifecycle("response.failed", failed))
        return events
