"""ResponsesRenderer: a response's engine outputs as a response object, or the Responses API's typed
event stream, straight from the engine's text (a thinking model's reasoning split off first, into a
reasoning item; the tool-call parser releases each call whole); and the response stored once it has ended
(completed, or incomplete on length).

If the database fails at that point the client still gets its response, with `store: false` saying that
it was not kept (and the failure logged): it was served and billed.
"""

import logging
import time
from typing import Any

from starlette.concurrency import run_in_threadpool

from app.completions.plan import Shape
from app.completions.reasoning import ReasoningStream
from app.completions.rendering import HEAVY_BLOCKS, HEAVY_CHARS, finish_reason
from app.completions.tool_calls import ParsedCall, ToolCallStream, parse
from app.errors import to_api_error
from app.responses.conversation import Conversation
from app.responses.objects import (
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputTokensDetails,
    ResponseError,
    ResponseObject,
    ResponseUsage,
)
from app.responses.output import OutputBuilder
from app.responses.store import ResponseStore, Stored
from deployments.engine.interface import RequestOutput

log = logging.getLogger(__name__)


class ResponsesRenderer:
    def __init__(
        self,
        response: ResponseObject,
        shape: Shape,
        *,
        tenant_id: str,
        conversation: Conversation,
        store: ResponseStore,
        previous: Stored | None = None,
    ) -> None:
        self.response = response  # as created: in progress, no output yet
        self.shape = shape
        self.tool_names = shape.tool_names
        self.tenant_id = tenant_id
        self.conversation = conversation  # what is stored with it
        self.store = store
        self.previous = previous  # the response it continues, read with its chain: stored by reference to it
        self.held = False  # its storage hold was taken (routes.prepare): `keep` or `release` ends it
        self.reset()

    def reset(self) -> None:
        self._builder = OutputBuilder()
        self._text: list[str] = []
        self._chars = 0
        self._tools = ToolCallStream(self.tool_names, self.shape.tool_format) if self.tool_names else None
        self._reasoning = ReasoningStream(self.shape.opened) if self.shape.reasoning else None
        self._thought: list[str] = []
        self._calls = 0
        self._finish: str | None = None
        self._gpu_limited: bool | None = None  # it ended at the request's GPU-time bound

    def heavy(self, out: RequestOutput | None = None) -> bool:
        if out is None:
            return self._chars >= HEAVY_CHARS or self._openings("".join(self._text)) >= HEAVY_BLOCKS
        chars = len(out.text)
        tools = self._tools
        if tools is not None and (out.finish_reason is not None or out.finished or tools.closes(out.text)):
            chars += tools.held
        return chars >= HEAVY_CHARS or self._openings(out.text) >= HEAVY_BLOCKS

    def _openings(self, text: str) -> int:
        return text.count(self.shape.tool_format.begin) if self.tool_names else 0

    def _split(self, out: RequestOutput) -> tuple[str, str]:
        """(reasoning, content) of an output's text, its tokens counted as chat counts them."""
        if self._reasoning is None:
            return "", out.text
        return self._reasoning.take(out.text, out.steps(), out.finish_reason is not None or out.finished)

    # -- whole responses ----------------------------------------------------------------------------

    def add(self, out: RequestOutput) -> None:
        reasoning, content = self._split(out)
        self._thought.append(reasoning)
        self._text.append(content)
        self._chars += len(out.text)
        if out.finish_reason is not None:
            self._finish = finish_reason(out)
            self._gpu_limited = out.gpu_limited or None

    def body(self, last: RequestOutput) -> dict[str, Any]:
        text = "".join(self._text)
        content: str | None = text
        calls: list[ParsedCall] = []
        if self.tool_names:
            content, calls = parse(text, self.tool_names, self.shape.tool_format)
        builder = OutputBuilder()
        builder.reasoning("".join(self._thought))
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
                self.store.save,
                self.tenant_id,
                body,
                self.conversation.context,
                self.conversation.items,
                self.previous,
            )
        except Exception:  # the response was served and billed: the client gets it, marked unstored
            log.exception("storing response %s failed", body["id"])
            await self.release()
            return {**body, "store": False}
        self.held = False  # the stored row took the hold's place
        return body

    async def release(self) -> None:
        """Drop the storage hold of a response that will not be stored (its request refused, failed or
        aborted); a failure is logged: the hold expires by itself."""
        if not self.held:
            return
        self.held = False
        try:
            await run_in_threadpool(self.store.release, self.response.id)
        except Exception:
            log.exception("releasing the storage hold of %s failed", self.response.id)

    async def closed(self, status: str) -> None:
        """The request closed (RequestLifecycle.at_close): unless it completed, nothing will be stored."""
        if status != "completed":
            await self.release()

    def _ended(self, items: list[OutputItem], last: RequestOutput, incomplete: bool) -> dict[str, Any]:
        usage = last.usage
        update: dict[str, Any] = {
            "status": "incomplete" if incomplete else "completed",
            "completed_at": None if incomplete else int(time.time()),
            "incomplete_details": (
                IncompleteDetails(reason="max_output_tokens", gpu_time_limited=self._gpu_limited)
                if incomplete
                else None
            ),
            "output": items,
        }
        if usage is not None:
            update["usage"] = ResponseUsage(
                input_tokens=usage.prompt_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_prompt_tokens),
                output_tokens=usage.completion_tokens,
                output_tokens_details=OutputTokensDetails(
                    reasoning_tokens=self._reasoning.tokens if self._reasoning is not None else 0
                ),
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
        reasoning, text = self._split(out)
        builder.reasoning(reasoning)
        if tools is None:
            builder.text(text)
        else:
            for piece in tools.feed(text) + (tools.finish() if ended else []):
                if isinstance(piece, str):
                    builder.text(piece)
                else:
                    self._calls += 1
                    builder.call_opens(piece.id, piece.name)
                    builder.call_arguments(piece.arguments)
        if ended:
            self._finish = finish_reason(out)
            self._gpu_limited = out.gpu_limited or None
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
