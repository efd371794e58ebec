"""RequestLifecycle: one planned request from the tier's policy to its usage row, in no wire shape and
with no HTTP request: the routes render it (app/completions/delivery.py), the Batch API runs it too.

`start` checks the policy, admits the request (rate limits, then its money held) and asks the engine for
its first output, so bad input (context too long, unknown adapter, overload) surfaces as an error before
any status is sent. Replica failover lives in `_engine_outputs` alone: a request whose engine replica is
lost while its client has seen none of its output runs again elsewhere. However it ends (completion,
client gone, engine failure), `close` stops what still runs, releases the lease with the tokens really
used, settles the money and hands exactly one RequestRecord to the observers; a request that ends before
any engine took it (rate limits, bad input) is counted by request_metrics.refused instead.
"""

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Self

from app import log_context, request_metrics
from app.auth.authenticator import Principal
from app.completions.admission import Admission, BudgetAsk
from app.completions.engine_stream import EngineStream, uncancellable
from app.completions.plan import RequestPlan
from app.completions.policy import allowed
from app.errors import APIError, to_api_error
from app.metering.request_record import RequestRecord, RequestStatus, tell
from app.services import Services
from billing.price_book import Metered
from deployments.engine.interface import (
    EngineRequest,
    FinishReason,
    Priority,
    PromptTooLong,
    ReplicaLost,
    RequestFailed,
    RequestOutput,
)

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3  # a request whose replica is lost before its client saw output runs at most this often
STOP_WAIT_S = 5.0  # how long a leaving client's request may take to report its final usage


@dataclass
class RequestLifecycle:
    services: Services
    principal: Principal
    plan: RequestPlan
    request_id: str
    stream: bool  # recorded with its usage
    started: float = field(default_factory=time.monotonic)
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    admission: Admission | None = None
    engine_request: EngineRequest | None = None
    streamed_tokens: int = 0  # output tokens passed on, for billing an aborted request without usage
    client_has_output: bool = False  # once true, a lost replica ends the request instead of restarting it
    engine_stream: EngineStream | None = None  # the current attempt's
    # A stream's lease outlives `close` until the proxy has delivered it (`delivered`): a client that
    # stops reading keeps its concurrency slot (closing_stream_response.py).
    lease_until_delivered: bool = False
    _undelivered_tokens: int | None = None
    _outputs: AsyncGenerator[RequestOutput, None] | None = None
    _headers: dict[str, str] | None = None
    _recorded: bool = False
    _closing: "asyncio.Future[None] | None" = None
    _at_close: list[Callable[[RequestStatus], Awaitable[None]]] = field(default_factory=list)
    # "batch": a Batch API line (app/batches/runner.py), outside the tenant's interactive rate limits (a
    # batch has its own bound, lines in flight) but not its money, and in the engine's batch class.
    priority: Priority = "interactive"
    batch_id: str | None = None  # a Batch API line's batch, on its usage row

    @classmethod
    def begin(
        cls,
        services: Services,
        principal: Principal,
        plan: RequestPlan,
        request_id: str,
        *,
        stream: bool,
        priority: Priority = "interactive",
    ) -> Self:
        target = plan.target
        # Not reset here: the middleware's reset ends the request's log context, after the stream.
        log_context.bind(model=target.name, adapter=None if target.adapter is None else str(target.adapter))
        return cls(services, principal, plan, request_id, stream, priority=priority)

    def headers(self) -> dict[str, str]:
        """The admission's rate-limit and budget headers for the response, as they stood when the first
        output came (settling the money later drops the budget's)."""
        if self._headers is not None:
            return self._headers
        return {} if self.admission is None else self.admission.headers()

    async def start(self) -> RequestOutput:
        """Admit the request and return its first output; refused, or failed before its first token, it
        raises the APIError to answer with (its admission's headers on it)."""
        try:
            return await self._start()
        except BaseException as error:
            if not self._recorded:  # no engine took it, so no RequestRecord: count it here
                self._count_refused(error)
            raise

    async def _start(self) -> RequestOutput:
        plan, principal = self.plan, self.principal
        allowance = allowed(plan, principal)  # before admission: a request that cannot run reserves nothing
        batch = self.priority == "batch"
        limits = principal.limits
        if batch:  # the rate limits are the interactive traffic's; max_tokens_cap still bounds the line
            limits = replace(limits, rpm=None, tpm=None, max_concurrent=None)
        self.admission = await Admission.acquire(
            self.services.limiter,
            tenant=principal.tenant_id,
            tier=principal.tier,
            request_id=self.request_id,
            limits=limits,
            reserve=plan.prompt_tokens + allowance.output_tokens,  # every prompt, every choice's most output
            fail_open=self.services.limiter_fail_open,
            sequences=allowance.sequences,  # concurrency counts what the engine runs, not HTTP requests
            budget=BudgetAsk.of(
                self.services.budget_guard,
                principal,
                plan.target,
                prompt_tokens=plan.prompt_tokens,
                output_tokens=allowance.output_tokens,
                batch=batch,
            ),
            # over its RPM, its next requests are refused before parsing
            refusals=None if batch else self.services.refusals,
        )
        self.engine_request = EngineRequest(
            request_id=self.request_id,
            prompt_ids=plan.prompts[0],
            params=allowance.params,
            adapter=plan.target.adapter,
            cache_salt=principal.tenant_id,  # tenants never share cached prefixes
            announce=True,  # so a client leaving before its first token still pays for its prefill
            more_prompts=tuple(plan.prompts[1:]),
            tenant=principal.tenant_id,  # the engine's fair share of its waiting queue
            tenant_weight=principal.weight,  # the tier's share in it
            max_gpu_ms=self.admission.max_gpu_ms,  # its hold covers this much GPU time, no more
            priority=self.priority,
            whole=not self.stream,  # answered at its end: no output a step to carry and wake for
        )
        self._outputs = self._engine_outputs()
        try:
            first = await anext(self._outputs)  # engine-side validation errors surface here
            if first.finish_reason is FinishReason.ERROR:  # failed before its first token (its adapter
                raise first.error or RequestFailed()  # could not be loaded): a status, not a 200 stream
        except BaseException as error:
            if not isinstance(error, Exception):  # cancelled: the client left before the first token
                await uncancellable(self.close("aborted"))
                raise
            await uncancellable(self.close("failed"))  # billed only if an engine had accepted it
            if isinstance(error, PromptTooLong):
                error = error.for_param(plan.prompt_param)
            raise await self.api_error(error) from None
        self._headers = self.admission.headers()
        return first

    async def next_output(self) -> RequestOutput:
        """The output after the last one; StopAsyncIteration past the end. (The admission's timer keeps
        its lease and hold alive meanwhile, output or none.)"""
        assert self.admission is not None and self._outputs is not None
        return await anext(self._outputs)

    async def api_error(self, error: Exception) -> APIError:
        """`error` as the APIError to answer with, the admission's headers on it."""
        ref = self.plan.target.adapter
        if ref is not None:
            error = await self.services.adapters.explain(self.principal, self.plan.target.name, ref, error)
        api_error = to_api_error(error)
        api_error.headers = {**self.headers(), **api_error.headers}
        return api_error

    def _count_refused(self, error: BaseException) -> None:
        target = self.plan.target
        try:
            request_metrics.refused(self.principal.tenant_id, target.name, target.base.name, error)
        except Exception:  # metrics must never change a response
            log.exception("counting refused request %s failed", self.request_id)

    async def _engine_outputs(self) -> AsyncGenerator[RequestOutput, None]:
        """This request's engine outputs, with the platform's one replica failover: when the replica
        running it is lost (ReplicaLost) while the client has seen none of its output, the request runs
        again from the start, under a fresh engine id (the lost attempt's abort may still be pending
        somewhere), on whichever replica the router now picks. Output a client has seen cannot be taken
        back: then the loss ends the request. A consumer sees a restart as a new request_id. Closing the
        engine stream is `close`'s business, not this generator's: it runs whenever the client leaves."""
        assert self.engine_request is not None
        base_model = self.plan.target.base.name
        for attempt in range(1, MAX_ATTEMPTS + 1):
            stream = EngineStream(self.services.engine, base_model, self.engine_request)
            self.engine_stream = stream
            self.streamed_tokens = 0
            try:
                while not stream.finished:
                    out = await stream.next()
                    self.streamed_tokens += len(out.token_ids)
                    yield out
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

    def at_close(self, callback: Callable[[RequestStatus], Awaitable[None]]) -> None:
        """Run `callback(status)` once the request has closed, after its lease and billing (e.g. a stored
        response's storage hold, dropped unless it completed)."""
        self._at_close.append(callback)

    async def _close(self, status: RequestStatus) -> None:
        try:
            await self._end(status)
        finally:
            for callback in self._at_close:
                try:
                    await callback(status)
                except Exception:  # one hook's failure must not keep the others, or the close, from ending
                    log.exception("a close hook of request %s failed", self.request_id)

    async def _end(self, status: RequestStatus) -> None:
        stream = self.engine_stream
        if stream is not None and not stream.finished and status == "aborted":
            last = await stream.stop(STOP_WAIT_S)
        else:
            last = None if stream is None else stream.last
            if stream is not None:
                await stream.close()
        if stream is None or not stream.accepted:  # no engine took it: nothing to bill (`start` counts it)
            if self.admission is not None:
                await self.admission.release(0)
            return
        if self.priority == "batch" and status in ("aborted", "failed"):
            # A Batch API line is billed only for the run that answers it: one whose runner stopped, or that
            # the platform failed, runs again under the same request id, metered and charged then, once (a
            # usage row and a settled hold of this try would take that id first); one that fails for good
            # goes to the error file unbilled.
            if self.admission is not None:
                await self.admission.abandon()
            return
        await self._finish(status, last)

    async def written(self) -> None:
        """A stream's last events are being written: from here its lease waits only on delivery."""
        if self.lease_until_delivered and self.admission is not None:
            await self.admission.delivering()

    async def delivered(self) -> None:
        """The response went out (or never will): free the lease that `close` kept for it."""
        used, self._undelivered_tokens = self._undelivered_tokens, None
        if used is not None and self.admission is not None:
            await self.admission.release(used)

    async def _finish(self, status: RequestStatus, last: RequestOutput | None) -> None:
        if self._recorded:
            return
        self._recorded = True
        usage = None if last is None else last.usage
        used = (
            usage.prompt_tokens + usage.completion_tokens
            if usage is not None
            else self.plan.prompt_tokens + self.streamed_tokens  # aborted: what the client got
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
            if self.lease_until_delivered:
                self._undelivered_tokens = used
            else:
                await self.admission.release(used)
        target = self.plan.target
        record = RequestRecord(
            request_id=self.request_id,
            tenant_id=self.principal.tenant_id,
            key_id=self.principal.key_id,
            model=target.name,
            base_model=target.base.name,
            adapter=target.adapter,
            status=status,
            finish_reason=None if last is None or last.finish_reason is None else str(last.finish_reason),
            usage=usage,
            started_at=self.started_at,
            latency_ms=(time.monotonic() - self.started) * 1e3,
            stream=self.stream,
            cost=cost,
            currency=None if cost is None else currency,
            batch_id=self.batch_id,
        )
        log.info(
            "generation %s: %s prompt + %s completion tokens in %.0f ms",
            status,
            "?" if usage is None else usage.prompt_tokens,
            "?" if usage is None else usage.completion_tokens,
            record.latency_ms,
        )  # the log context adds request_id, tenant, model and adapter
        await tell(self.services.observers, record)
