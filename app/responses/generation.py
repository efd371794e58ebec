"""ResponseGeneration: a Generation (limits, engine, failover, billing: the chat path's) whose output is a
response object, or the Responses API's typed event stream, and which stores what it served.

One engine request, one RequestRecord, one usage row, as for chat. A response is stored only once it has
ended (completed, or incomplete on length); if the database fails it then, the client still gets its
response, with `store: false` saying that it was not kept (and the failure logged).
"""

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from app.completions.choices import Choices
from app.completions.engine_stream import uncancellable
from app.completions.generation import Generation
from app.errors import to_api_error
from app.metering.request_record import RequestStatus
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
from app.schemas.openai import ChatChoice, ChatChunkChoice
from deployments.engine.interface import EngineError, FinishReason, RequestFailed, RequestOutput

log = logging.getLogger(__name__)


@dataclass
class ResponseGeneration(Generation):
    response: ResponseObject | None = None  # as created: in progress, no output yet
    conversation: Conversation | None = None  # what is stored with it
    store: ResponseStore | None = None
    final: dict[str, Any] | None = None  # the response body, once built

    def prepared(self, response: ResponseObject, conversation: Conversation, store: ResponseStore) -> None:
        self.response, self.conversation, self.store = response, conversation, store

    # -- whole responses ----------------------------------------------------------------------------

    def _final_body(self, choices: Choices, last: RequestOutput) -> dict[str, Any]:
        choice = choices.final()[0]
        assert isinstance(choice, ChatChoice)
        builder = OutputBuilder()
        if choice.message.content:
            builder.text(choice.message.content)
        for call in choice.message.tool_calls or ():
            builder.call(call.id, call.function.name, call.function.arguments)
        builder.finish("incomplete" if choice.finish_reason == "length" else "completed")
        self.final = self._ended(builder.items, last, choice.finish_reason)
        return self.final

    async def _collect(
        self,
        first: RequestOutput,
        outputs: AsyncGenerator[RequestOutput, None],
        headers: dict[str, str],
        choices: Choices,
    ) -> JSONResponse:
        response = await super()._collect(first, outputs, headers, choices)
        assert self.final is not None
        if await self._stored(self.final):
            return response
        return JSONResponse({**self.final, "store": False}, headers=headers)

    def _ended(self, items: list[OutputItem], last: RequestOutput, finish: str | None) -> dict[str, Any]:
        assert self.response is not None
        incomplete = finish == "length"
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

    async def _stored(self, body: dict[str, Any]) -> bool:
        """Keep `body` if the request asked to; False when it asked and the database failed."""
        if not body["store"] or self.store is None or self.conversation is None:
            return True
        try:
            await run_in_threadpool(
                self.store.save,
                self.principal.tenant_id,
                body,
                self.conversation.context,
                self.conversation.items,
            )
        except Exception:  # the response was served and billed: the client gets it, marked unstored
            log.exception("storing response %s failed", body["id"])
            return False
        return True

    # -- streams --------------------------------------------------------------------------------------

    async def _sse(
        self, first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None], choices: Choices
    ) -> AsyncIterator[str]:
        assert self.response is not None
        builder = OutputBuilder()
        last = first
        finish: str | None = None
        status: RequestStatus = "aborted"
        try:
            self.client_has_output = True
            yield builder.lifecycle("response.created", self.response)
            yield builder.lifecycle("response.in_progress", self.response)
            out: RequestOutput | None = first
            while out is not None:
                last = out
                self.streamed_tokens += len(out.token_ids)
                if out.finish_reason is FinishReason.ERROR:
                    status = "failed"
                    for event in self._failed(builder, out.error or RequestFailed()):
                        yield event
                    return
                if choices.heavy(out):
                    pieces = await run_in_threadpool(choices.chunk, out)
                else:
                    pieces = choices.chunk(out)
                for piece in pieces:
                    assert isinstance(piece, ChatChunkChoice)
                    finish = _feed(builder, piece) or finish
                for event in builder.take():
                    yield event
                if out.finished:
                    out = None
                else:
                    assert self.admission is not None
                    await self.admission.renew_if_due()
                    out = await anext(outputs)
            status = "completed"
            builder.finish("incomplete" if finish == "length" else "completed")
            for event in builder.take():
                yield event
            body = self._ended(builder.items, last, finish)
            if not await self._stored(body):
                body["store"] = False
            kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
            yield builder.event(kind, response=body)
        except EngineError as error:  # e.g. the replica died mid-stream: say so in the stream, then end it
            status = "failed"
            for event in self._failed(builder, error):
                yield event
        finally:
            # Leaving early (client gone, cancellation) stops the engine request and bills what it did.
            await uncancellable(self.close(status))

    def _failed(self, builder: OutputBuilder, error: Exception) -> list[str]:
        """An `error` event in OpenAI's shape, then `response.failed` with what was output so far."""
        assert self.response is not None
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


def _feed(builder: OutputBuilder, piece: ChatChunkChoice) -> str | None:
    """One chat stream piece into the builder; its finish reason, if it has one."""
    delta = piece.delta
    if delta.content:
        builder.text(delta.content)
    for call in delta.tool_calls or ():
        if call.id is not None and call.function.name is not None:
            builder.call_opens(call.id, call.function.name)
        if call.function.arguments:
            builder.call_arguments(call.function.arguments)
    return piece.finish_reason
