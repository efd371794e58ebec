"""Generation: one request through the engine, shaped as an OpenAI response or SSE stream.

The engine is asked for its first output before any HTTP status is sent, so bad input (context too long,
unknown adapter, overload) still gets a proper 4xx/5xx instead of a 200 stream with an error inside.
Whatever happens afterwards (completion, client disconnect, engine failure), exactly one RequestRecord
goes to the observers.
"""

import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from fastapi.responses import JSONResponse, StreamingResponse

from app.authenticator import Principal
from app.errors import APIError
from app.observers import RequestRecord, RequestStatus
from app.schemas.openai import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    PromptTokensDetails,
    SamplingFields,
    Usage,
)
from app.services import Services, Target
from deployments.engine.errors import PromptTooLong
from deployments.engine.outputs import RequestOutput, RequestUsage
from deployments.engine.request import EngineRequest
from deployments.engine.sampling_params import SamplingParams
from deployments.engine.sequence import FinishReason

log = logging.getLogger(__name__)
Kind = Literal["chat", "completion"]


def sampling_params(body: SamplingFields, max_tokens: int | None) -> SamplingParams:
    """OpenAI defaults where the request is silent (temperature 1, top_p 1)."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        seed=body.seed,
        stop=tuple(body.stop_list),
    )


def usage_block(usage: RequestUsage | None) -> Usage:
    if usage is None:
        return Usage(
            prompt_tokens=0, completion_tokens=0, total_tokens=0, prompt_tokens_details=PromptTokensDetails()
        )
    return Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_prompt_tokens),
    )


def finish_reason(out: RequestOutput) -> str | None:
    if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
        return str(out.finish_reason)
    return None


@dataclass
class Generation:
    services: Services
    principal: Principal
    target: Target
    request_id: str
    kind: Kind
    stream: bool
    include_usage: bool
    started: float  # time.monotonic() at arrival
    started_at: datetime
    _recorded: bool = False

    @classmethod
    def begin(
        cls,
        services: Services,
        principal: Principal,
        target: Target,
        request_id: str,
        kind: Kind,
        body: SamplingFields,
    ) -> "Generation":
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        now = time.monotonic(), datetime.now(UTC)
        return cls(services, principal, target, request_id, kind, body.stream, include_usage, *now)

    async def respond(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> JSONResponse | StreamingResponse:
        request = EngineRequest(
            request_id=self.request_id,
            prompt_ids=prompt_ids,
            params=params,
            adapter=self.target.adapter,
            cache_salt=self.principal.tenant_id,  # tenants never share cached prefixes
        )
        outputs = self.services.engine.generate(self.target.base.name, request)
        try:
            first = await anext(outputs)  # engine-side validation errors surface here, before any status
        except PromptTooLong as error:
            field = "messages" if self.kind == "chat" else "prompt"
            raise APIError(400, str(error), param=field, code="context_length_exceeded") from None
        if self.stream:
            return StreamingResponse(
                self._sse(first, outputs),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
            )
        return await self._collect(first, outputs)

    async def _collect(
        self, first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None]
    ) -> JSONResponse:
        text: list[str] = []
        last = first
        try:
            text.append(first.text)
            while not last.finished:
                last = await anext(outputs)
                text.append(last.text)
        except BaseException:
            await self._finish("aborted", last)
            await outputs.aclose()
            raise
        if last.finish_reason is FinishReason.ERROR:
            await self._finish("failed", last)
            raise generation_failed(last)
        await self._finish("completed", last)
        body = self._final_body("".join(text), last)
        return JSONResponse(body)

    def _final_body(self, text: str, last: RequestOutput) -> dict[str, Any]:
        usage = usage_block(last.usage)
        if self.kind == "chat":
            return ChatCompletion(
                id=self.request_id,
                model=self.target.name,
                choices=[
                    ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason(last))
                ],
                usage=usage,
            ).model_dump()
        return Completion(
            id=self.request_id,
            model=self.target.name,
            choices=[CompletionChoice(text=text, finish_reason=finish_reason(last))],
            usage=usage,
        ).model_dump()

    async def _sse(
        self, first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None]
    ) -> AsyncIterator[str]:
        created = int(time.time())
        chunk = self._chunk_factory(created)
        last = first
        status: RequestStatus = "aborted"
        try:
            if self.kind == "chat":
                yield _event(chunk(ChatDelta(role="assistant", content=""), None))
            out: RequestOutput | None = first
            while out is not None:
                last = out
                if out.finish_reason is FinishReason.ERROR:
                    status = "failed"
                    yield _event(generation_failed(out).body())
                    return
                if out.text or out.finished:
                    reason = finish_reason(out) if out.finished else None
                    yield _event(
                        chunk(ChatDelta(content=out.text) if self.kind == "chat" else out.text, reason)
                    )
                out = None if out.finished else await anext(outputs)
            status = "completed"
            if self.include_usage:
                yield _event(self._usage_chunk(created, last))
            yield "data: [DONE]\n\n"
        finally:
            # Leaving early (client gone, cancellation) closes the engine stream, which aborts generation.
            await outputs.aclose()
            await self._finish(status, last)

    def _chunk_factory(self, created: int) -> Callable[[Any, str | None], dict[str, Any]]:
        def chunk(delta: Any, reason: str | None) -> dict[str, Any]:
            if self.kind == "chat":
                choice = ChatChunkChoice(delta=delta, finish_reason=reason)
                chat = ChatCompletionChunk(
                    id=self.request_id, created=created, model=self.target.name, choices=[choice]
                )
                return chat.model_dump()
            text = CompletionChoice(text=delta, finish_reason=reason)
            return Completion(
                id=self.request_id, created=created, model=self.target.name, choices=[text]
            ).model_dump()

        return chunk

    def _usage_chunk(self, created: int, last: RequestOutput) -> dict[str, Any]:
        usage = usage_block(last.usage)
        if self.kind == "chat":
            chat = ChatCompletionChunk(
                id=self.request_id, created=created, model=self.target.name, choices=[], usage=usage
            )
            return chat.model_dump()
        text = Completion(
            id=self.request_id, created=created, model=self.target.name, choices=[], usage=usage
        )
        return text.model_dump()

    async def _finish(self, status: RequestStatus, last: RequestOutput | None) -> None:
        if self._recorded:
            return
        self._recorded = True
        record = RequestRecord(
            request_id=self.request_id,
            tenant_id=self.principal.tenant_id,
            key_id=self.principal.key_id,
            model=self.target.name,
            base_model=self.target.base.name,
            adapter=None if self.target.adapter is None else str(self.target.adapter),
            status=status,
            finish_reason=None if last is None or last.finish_reason is None else str(last.finish_reason),
            usage=None if last is None else last.usage,
            started_at=self.started_at,
            latency_ms=(time.monotonic() - self.started) * 1e3,
            stream=self.stream,
        )
        for observer in self.services.observers:
            try:
                await observer.on_finish(record)
            except Exception:  # an observer must never break a response
                log.exception("observer %r failed on %s", observer, self.request_id)


def generation_failed(out: RequestOutput) -> APIError:
    return APIError(
        500, f"The model failed while generating: {out.error}", type="server_error", code="generation_failed"
    )


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
