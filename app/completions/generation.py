"""Generation: one request through the rate limiter and the engine, shaped as an OpenAI response or stream.

The engine is asked for its first output before any HTTP status is sent, so bad input (context too long,
unknown adapter, overload) still gets a proper 4xx/5xx instead of a 200 stream with an error inside.
Replica failover lives here, in `_engine_outputs` alone: a request whose engine replica is lost while its
client has seen none of its output runs again elsewhere.
Whatever happens afterwards (completion, client disconnect, engine failure), the rate-limit lease is
released with the tokens really used, and exactly one RequestRecord goes to the observers; a request that
ends before any engine took it (rate limits, bad input) is counted by request_metrics.refused instead.
"""

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Literal, Self

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from adapters.errors import AdapterLoadFailed, AdapterNotFound
from app import log_context, request_metrics
from app.auth.authenticator import Principal
from app.completions.admission import Admission, BudgetAsk, concurrency_limit
from app.completions.choices import Choices, Shape
from app.completions.closing_stream_response import ClosingStreamingResponse
from app.completions.engine_stream import EngineStream, uncancellable
from app.errors import InvalidParameter, ModelNotFound, TooManySequences, to_api_error
from app.metering.request_record import RequestRecord, RequestStatus
from app.schemas.openai import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    PromptTokensDetails,
    SamplingFields,
    Usage,
)
from app.services import Services, Target
from billing.price_book import Metered
from deployments.engine.interface import (
    EngineError,
    EngineRequest,
    FinishReason,
    PromptTooLong,
    ReplicaLost,
    RequestFailed,
    RequestOutput,
    RequestUsage,
    SamplingParams,
)

log = logging.getLogger(__name__)
Kind = Literal["chat", "completion"]
COMPLETIONS_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI
MAX_ATTEMPTS = 3  # a request whose replica is lost before its client saw output runs at most this often
STOP_WAIT_S = 5.0  # how long a leaving client's request may take to report its final usage


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


@dataclass
class Generation:
    services: Services
    principal: Principal
    target: Target
    request_id: str
    kind: Kind
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: the usage so far on every chunk
    started: float = field(default_factory=time.monotonic)
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    admission: Admission | None = None
    engine_request: EngineRequest | None = None
    prompt_tokens: int = 0  # all prompts together
    longest_prompt: int = 0
    streamed_tokens: int = 0  # what the client received, for reconciling an aborted request
    client_has_output: bool = False  # once true, a lost replica ends the request instead of restarting it
    engine_stream: EngineStream | None = None  # the current attempt's
    _recorded: bool = False
    _closing: "asyncio.Future[None] | None" = None

    @classmethod
    def begin(
        cls,
        services: Services,
        principal: Principal,
        target: Target,
        request_id: str,
        kind: Kind,
        body: SamplingFields,
    ) -> Self:
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        # Not reset here: the middleware's reset ends the request's log context, after the stream.
        log_context.bind(model=target.name, adapter=None if target.adapter is None else str(target.adapter))
        return cls(services, principal, target, request_id, kind, body.stream, include_usage, continuous)

    async def respond(
        self, prompts: list[list[int]], params: SamplingParams, shape: Shape | None = None
    ) -> JSONResponse | StreamingResponse:
        """Run `prompts` (one, or a /v1/completions list; each with params.n choices) as one engine
        request; `shape` says what the choices carry beyond text."""
        try:
            return await self._respond(prompts, params, shape or Shape(n=params.n))
        except BaseException as error:
            if not self._recorded:  # no engine took it, so no RequestRecord: count it here
                self._count_refused(error)
            raise

    def _count_refused(self, error: BaseException) -> None:
        try:
            request_metrics.refused(self.principal.tenant_id, self.target.name, self.target.base.name, error)
        except Exception:  # metrics must never change a response
            log.exception("counting refused request %s failed", self.request_id)

    async def _respond(
        self, prompts: list[list[int]], params: SamplingParams, shape: Shape
    ) -> JSONResponse | StreamingResponse:
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.longest_prompt = max(len(p) for p in prompts)
        self._check_context(prompts, params)  # before admission: a request that cannot run reserves nothing
        sequences = self._check_sequences(prompts, params)
        params = self._capped(params)
        room = self.target.base.max_model_len - self.longest_prompt
        output = params.max_tokens if params.max_tokens is not None else max(room, 0)
        self.admission = await Admission.acquire(
            self.services.limiter,
            tenant=self.principal.tenant_id,
            tier=self.principal.tier,
            request_id=self.request_id,
            limits=self.principal.limits,
            # every prompt once, and every choice of every prompt its max_tokens
            reserve=self.prompt_tokens + params.n * len(prompts) * output,
            fail_open=self.services.limiter_fail_open,
            sequences=sequences,  # concurrency counts what the engine runs, not HTTP requests
            budget=self._budget_ask(params.n * len(prompts) * output),
        )
        self.engine_request = EngineRequest(
            request_id=self.request_id,
            prompt_ids=prompts[0],
            params=params,
            adapter=self.target.adapter,
            cache_salt=self.principal.tenant_id,  # tenants never share cached prefixes
            announce=True,  # so a client leaving before its first token still pays for its prefill
            more_prompts=tuple(prompts[1:]),
            tenant=self.principal.tenant_id,  # the engine's fair share of its waiting queue
            max_gpu_ms=self.admission.max_gpu_ms,  # its hold covers this much GPU time, no more
        )
        choices = Choices(self.kind, shape, prompts, self.target.base.prompts.tokens)
        outputs = self._engine_outputs()
        try:
            first = await anext(outputs)  # engine-side validation errors surface here, before any status
            if first.finish_reason is FinishReason.ERROR:  # failed before its first token (its adapter
                raise first.error or RequestFailed()  # could not be loaded): a status, not a 200 stream
        except BaseException as error:
            if not isinstance(error, Exception):  # cancelled: the client left before the first token
                await uncancellable(self.close("aborted"))
                raise
            await uncancellable(self.close("failed"))  # billed only if an engine had accepted it
            if isinstance(error, PromptTooLong) and self.kind == "chat":
                error = error.for_param("messages")
            api_error = to_api_error(await self._explained(error))  # the admission's headers ride on it
            api_error.headers = {**self.admission.headers(), **api_error.headers}
            raise api_error from None
        headers = self.admission.headers()
        if self.stream:
            return ClosingStreamingResponse(
                self._sse(first, outputs, choices),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache", "x-accel-buffering": "no", **headers},
                on_close=lambda: self.close("aborted"),  # a no-op when the stream ended by itself
            )
        return await self._collect(first, outputs, headers, choices)

    def _budget_ask(self, output_tokens: int) -> BudgetAsk | None:
        """The request's money for admission: its prompts and its most output, on its model or adapter."""
        guard = self.services.budget_guard
        if guard is None:
            return None
        adapter = self.target.adapter
        return BudgetAsk(
            guard=guard,
            budgeted=self.principal.budgeted,
            base_model=self.target.base.name,
            adapter_id=None if adapter is None else adapter.adapter_id,
            prompt_tokens=self.prompt_tokens,
            output_tokens=output_tokens,
        )

    async def _explained(self, error: Exception) -> Exception:
        """The engine found no stored version of this request's adapter: deleted since the ingress resolved
        its name (cached for a moment), so the model is gone (404); or the registry still lists it and the
        store lost its files, which is the platform's fault (503, logged). The registry decides, afresh."""
        ref = self.target.adapter
        if not isinstance(error, AdapterNotFound) or ref is None:
            return error
        try:
            gone = await self.services.adapters.recheck(self.principal, self.target.name) is None
        except Exception:  # the registry is unreachable: the platform's trouble either way
            log.exception("rechecking adapter %s in the registry failed", ref)
            gone = False
        if gone:
            return ModelNotFound(self.target.name)
        log.warning("adapter %s is registered but its engine cannot find it: %s", ref, error)
        return AdapterLoadFailed(str(ref), "the registry lists it but the store does not hold it")

    async def _engine_outputs(self) -> AsyncGenerator[RequestOutput, None]:
        """This request's engine outputs, with the platform's one replica failover: when the replica
        running it is lost (ReplicaLost) while the client has seen none of its output, the request runs
        again from the start, under a fresh engine id (the lost attempt's abort may still be pending
        somewhere), on whichever replica the router now picks. Output a client has seen cannot be taken
        back: then the loss ends the request. A consumer sees a restart as a new request_id. Closing the
        engine stream is `close`'s business, not this generator's: it runs whenever the client leaves."""
        assert self.engine_request is not None
        for attempt in range(1, MAX_ATTEMPTS + 1):
            stream = EngineStream(self.services.engine, self.target.base.name, self.engine_request)
            self.engine_stream = stream
            try:
                while not stream.finished:
                    yield await stream.next()
                return
            except ReplicaLost:
                if self.client_has_output or attempt == MAX_ATTEMPTS:
                    raise
                log.warning("request %s lost its engine replica; running it again", self.request_id)
                await stream.close()
            self.engine_request = replace(self.engine_request, request_id=f"{self.request_id}.r{attempt}")

    async def close(self, status: RequestStatus) -> None:
        """End the request once, however many paths get here (the stream's own end, the response's close,
        a cancelled handler): stop the engine request if it still runs (`aborted`), then release the lease
        and bill what the engine processed. A request no engine accepted is released with nothing."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close(status))
        await asyncio.shield(self._closing)

    async def _close(self, status: RequestStatus) -> None:
        stream = self.engine_stream
        if stream is not None and not stream.finished and status == "aborted":
            last = await stream.stop(STOP_WAIT_S)
        else:
            last = None if stream is None else stream.last
            if stream is not None:
                await stream.close()
        if stream is None or not stream.accepted:  # no engine took it: nothing to bill (`respond` counts it)
            if self.admission is not None:
                await self.admission.release(0)
            return
        await self._finish(status, last)

    def _check_context(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """What no engine of this model can serve: a prompt that fills the context, or max_tokens past it."""
        context = self.target.base.max_model_len
        for number, prompt in enumerate(prompts):
            if len(prompt) < context:
                continue
            which = f"prompt {number} of {len(prompts)}" if len(prompts) > 1 else "the prompt"
            message = (
                f"This model's context is {context} tokens; {which} has {len(prompt)} "
                "and leaves no room for output."
            )
            param = "messages" if self.kind == "chat" else "prompt"
            raise InvalidParameter(message, param=param, code="context_length_exceeded")
        if params.max_tokens is not None and params.max_tokens > context:
            message = f"max_tokens {params.max_tokens} exceeds this model's context of {context} tokens."
            raise InvalidParameter(message, param="max_tokens", code="context_length_exceeded")

    def _check_sequences(self, prompts: list[list[int]], params: SamplingParams) -> int:
        """The sequences the request runs (n per prompt), refused at once past what one request may run on
        this model (the engine's max_num_seqs) or past the tier's concurrency: no wait could make room."""
        sequences = params.n * len(prompts)
        per_request = self.target.base.spec.max_num_seqs
        limit = None
        if sequences > per_request:
            limit = f"one request runs at most {per_request} sequences on this model"
        elif sequences > (self.principal.limits.max_concurrent or sequences):
            limit = concurrency_limit(self.principal.limits, self.principal.tier)
        if limit is not None:
            raise TooManySequences(sequences, limit, n=params.n, prompts=len(prompts))
        return sequences

    def _capped(self, params: SamplingParams) -> SamplingParams:
        """The tier's max_tokens cap: asking for more is an error; asking for nothing means the cap."""
        cap = self.principal.limits.max_tokens_cap
        if params.max_tokens is None and self.kind != "chat":  # OpenAI's default for completions, capped
            params = replace(params, max_tokens=min(COMPLETIONS_MAX_TOKENS, cap or COMPLETIONS_MAX_TOKENS))
        if cap is None:
            return params
        if params.max_tokens is not None and params.max_tokens > cap:
            message = (
                f"max_tokens {params.max_tokens} exceeds the cap of {cap} for tier {self.principal.tier}"
            )
            raise InvalidParameter(message, param="max_tokens", code="max_tokens_over_cap")
        if params.max_tokens is None:
            room = self.target.base.max_model_len - self.longest_prompt
            return replace(params, max_tokens=max(1, min(cap, room)))
        return params

    async def _collect(
        self,
        first: RequestOutput,
        outputs: AsyncGenerator[RequestOutput, None],
        headers: dict[str, str],
        choices: Choices,
    ) -> JSONResponse:
        last = first
        failed: RequestOutput | None = None
        try:
            out: RequestOutput | None = first
            while out is not None:
                if out.request_id != last.request_id:  # run again after a lost replica: start over
                    choices.reset()
                    self.streamed_tokens = 0
                last = out
                if out.finish_reason is FinishReason.ERROR:
                    failed = out
                if choices.heavy(out):
                    await run_in_threadpool(choices.add, out)
                else:
                    choices.add(out)
                self.streamed_tokens += len(out.token_ids)
                if out.finished:
                    break
                assert self.admission is not None
                await self.admission.renew_if_due()
                out = await anext(outputs)
        except BaseException as stopped:
            await uncancellable(self.close("failed" if isinstance(stopped, EngineError) else "aborted"))
            raise
        if failed is not None:
            await uncancellable(self.close("failed"))
            error = to_api_error(await self._explained(failed.error or RequestFailed()))
            error.headers = {**headers, **error.headers}
            raise error
        await uncancellable(self.close("completed"))
        if choices.heavy():
            return await run_in_threadpool(self._final_response, choices, last, headers)
        return self._final_response(choices, last, headers)

    def _final_response(self, choices: Choices, last: RequestOutput, headers: dict[str, str]) -> JSONResponse:
        """The body shaped (tool calls parsed, logprobs built) and rendered: a JSONResponse renders its
        bytes as it is made, so all of the work happens wherever this runs."""
        return JSONResponse(self._final_body(choices, last), headers=headers)

    def _final_body(self, choices: Choices, last: RequestOutput) -> dict[str, Any]:
        usage = usage_block(last.usage)
        shaped = choices.final()
        if self.kind == "chat":
            chat = [c for c in shaped if isinstance(c, ChatChoice)]
            return ChatCompletion(
                id=self.request_id, model=self.target.name, choices=chat, usage=usage
            ).model_dump()
        texts = [c for c in shaped if isinstance(c, CompletionChoice)]
        return Completion(id=self.request_id, model=self.target.name, choices=texts, usage=usage).model_dump()

    async def _sse(
        self, first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None], choices: Choices
    ) -> AsyncIterator[str]:
        created = int(time.time())
        last = first
        status: RequestStatus = "aborted"
        try:
            self.client_has_output = True
            if self.kind == "chat":
                for opening in choices.opening():
                    yield _event(self._chunk(created, opening, first.usage))
            out: RequestOutput | None = first
            while out is not None:
                last = out
                self.streamed_tokens += len(out.token_ids)
                if out.finish_reason is FinishReason.ERROR:
                    status = "failed"
                    yield _event(to_api_error(out.error or RequestFailed()).body())
                    return
                if choices.heavy(out):
                    events = await run_in_threadpool(self._events, created, choices, out)
                else:
                    events = self._events(created, choices, out)
                for event in events:
                    yield event
                if out.finished:
                    out = None
                else:
                    assert self.admission is not None
                    await self.admission.renew_if_due()
                    out = await anext(outputs)
            status = "completed"
            if self.include_usage:
                yield _event(self._usage_chunk(created, last))
            yield "data: [DONE]\n\n"
        except EngineError as error:  # e.g. the replica died mid-stream: say so in the stream, then end it
            status = "failed"
            yield _event(to_api_error(error).body())
        finally:
            # Leaving early (client gone, cancellation) stops the engine request and bills what it did.
            await uncancellable(self.close(status))

    def _events(self, created: int, choices: Choices, out: RequestOutput) -> list[str]:
        """The stream's events for one output, shaped and rendered."""
        return [_event(self._chunk(created, choice, out.usage)) for choice in choices.chunk(out)]

    def _chunk(
        self, created: int, choice: ChatChunkChoice | CompletionChoice, usage: RequestUsage | None = None
    ) -> dict[str, Any]:
        so_far = usage_block(usage) if self.continuous_usage else None
        if isinstance(choice, ChatChunkChoice):
            chat = ChatCompletionChunk(
                id=self.request_id, created=created, model=self.target.name, choices=[choice], usage=so_far
            ).model_dump()
            delta = chat["choices"][0]["delta"]
            if delta["tool_calls"] is not None:  # only what each piece says: the SDK joins them by index
                delta["tool_calls"] = [
                    call.model_dump(exclude_none=True) for call in choice.delta.tool_calls or ()
                ]
            return chat
        return Completion(
            id=self.request_id, created=created, model=self.target.name, choices=[choice], usage=so_far
        ).model_dump()

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
        usage = None if last is None else last.usage
        used = (
            usage.prompt_tokens + usage.completion_tokens
            if usage is not None
            else self.prompt_tokens + self.streamed_tokens  # aborted: what the client got
        )
        cost = currency = None
        if self.admission is not None:
            metered = (
                None
                if usage is None
                else Metered(
                    usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens, usage.gpu_ms
                )
            )
            hold = self.admission.hold
            cost = await self.admission.settle(metered)
            currency = None if hold is None else hold.prices.currency
            await self.admission.release(used)
        record = RequestRecord(
            request_id=self.request_id,
            tenant_id=self.principal.tenant_id,
            key_id=self.principal.key_id,
            model=self.target.name,
            base_model=self.target.base.name,
            adapter=self.target.adapter,
            status=status,
            finish_reason=None if last is None or last.finish_reason is None else str(last.finish_reason),
            usage=usage,
            started_at=self.started_at,
            latency_ms=(time.monotonic() - self.started) * 1e3,
            stream=self.stream,
            cost=cost,
            currency=None if cost is None else currency,
        )
        log.info(
            "generation %s: %s prompt + %s completion tokens in %.0f ms",
            status,
            "?" if usage is None else usage.prompt_tokens,
            "?" if usage is None else usage.completion_tokens,
            record.latency_ms,
        )  # the log context adds request_id, tenant, model and adapter
        for observer in self.services.observers:
            try:
                await observer.on_finish(record)
            except Exception:  # an observer must never break a response
                log.exception("observer %r failed on %s", observer, self.request_id)


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
