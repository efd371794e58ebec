"""Admission: one request's passage through the tenant's rate limits, from admit to release.

Reject tiers get a 429 at once; queue tiers wait (in arrival order) up to max_queue_ms, then 429. The
waiting is the backend's, in one admit call (no polling from here), and a tenant with too many waiters
already gets its 429 at once (queue_full). The token reservation is prompt + max_tokens (or the tier's
cap), and on release it is replaced by what the request really used, so a tenant who asked for 1000
tokens and used 10 gets 990 back at once.

Money (issue 29) is admitted here too, right after the rate limits: a BudgetAsk makes admission hold the
request's worst-case cost (app/budgets/guard.py) and release settles it to the metered cost. A request
refused for money gives its rate-limit lease straight back. Every route that runs an engine request
(chat, completions, and /v1/responses) goes through Admission.acquire with its BudgetAsk.

The lease and the hold live as long as their request (issue 35): from acquire to release a timer renews
both every third of the shorter of their TTLs, whether or not any output arrives (a long engine queue or
prefill sends none), so neither lapses while the request can still be charged.
"""

import asyncio
import dataclasses
import logging
import time
import weakref
from dataclasses import dataclass
from decimal import Decimal

import anyio

from app.auth.authenticator import Principal
from app.background_retry import retry_in_background
from app.budgets.guard import BudgetGuard, BudgetHold
from app.errors import RateLimited, RequestTooLarge, TooManySequences
from app.limits import Decision, LimiterBackend, LimiterUnavailable, Limits
from app.limits.protocol import DELIVERY_GRACE_MS
from app.limits.refusal_cache import RefusalCache
from app.metrics import Counter
from app.services import Target
from billing.price_book import Metered

log = logging.getLogger(__name__)
RENEWALS_PER_TTL = 3  # the timer renews three times per TTL: two renewals may fail before anything lapses

# reason: requests, tokens, concurrency or queued (a limit was reached), queue_full (too many waiters
# already), too_large (more than a minute's tokens), too_many_sequences (more than max_concurrent),
# unavailable (the limiter could not be reached and the ingress fails closed).
REJECTIONS = Counter(
    "loraplex_limiter_rejections", "Requests the rate limiter refused.", ("tenant", "reason")
)


@dataclass(frozen=True)
class BudgetAsk:
    """What admission needs to hold a request's money: its worst case in tokens, and where it runs."""

    guard: BudgetGuard
    budgeted: bool  # the tenant has credit or a spend limit (otherwise the request is only priced)
    base_model: str
    adapter_id: str | None
    prompt_tokens: int
    output_tokens: int  # max_tokens x choices x prompts
    # its prices are the tier's times this (a batch line's: the tier's batch price factor)
    price_factor: Decimal = Decimal(1)

    @classmethod
    def of(
        cls,
        guard: BudgetGuard | None,
        principal: Principal,
        target: Target,
        *,
        prompt_tokens: int,
        output_tokens: int,
        batch: bool,
    ) -> "BudgetAsk | None":
        """A request's money for admission: its prompts and its most output, on its model or adapter; None
        when no guard holds money."""
        if guard is None:
            return None
        return cls(
            guard=guard,
            budgeted=principal.budgeted,
            base_model=target.base.name,
            adapter_id=None if target.adapter is None else target.adapter.adapter_id,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            price_factor=principal.batch_price_factor if batch else Decimal(1),
        )


@dataclass
class Admission:
    backend: LimiterBackend | None  # None: nothing to release (unlimited, or the limiter was down, fail-open)
    tenant: str
    request_id: str
    limits: Limits
    decision: Decision | None
    _released: bool = False
    guard: BudgetGuard | None = None
    hold: BudgetHold | None = None  # the request's money, settled by release
    _renewer: "asyncio.Task[None] | None" = None  # renews the lease and the hold until release

    @classmethod
    async def acquire(
        cls,
        backend: LimiterBackend,
        *,
        tenant: str,
        tier: str,
        request_id: str,
        limits: Limits,
        reserve: int,
        fail_open: bool,
        sequences: int = 1,
        budget: BudgetAsk | None = None,
        refusals: RefusalCache | None = None,
    ) -> "Admission":
        """The rate limits, then (with `budget`) the money; refused for money, the lease goes back.
        `refusals` keeps a requests-per-minute refusal for a moment (app/limits/refusal_cache.py)."""
        admission = await cls._acquire_rate(
            backend, tenant=tenant, tier=tier, request_id=request_id, limits=limits, reserve=reserve,
            fail_open=fail_open, sequences=sequences, refusals=refusals,
        )  # fmt: skip
        if budget is None:
            admission._start_renewing()
            return admission
        try:
            admission.hold = await budget.guard.hold(
                tenant_id=tenant, budgeted=budget.budgeted, request_id=request_id,
                base_model=budget.base_model, adapter_id=budget.adapter_id,
                prompt_tokens=budget.prompt_tokens, output_tokens=budget.output_tokens,
                price_factor=budget.price_factor,
            )  # fmt: skip
        except BaseException as error:
            _count_rejection(tenant, "budget" if getattr(error, "status", 0) == 429 else "budget_unavailable")
            await admission.release(0)
            raise
        admission.guard = budget.guard
        admission._start_renewing()
        return admission

    @classmethod
    async def _acquire_rate(
        cls,
        backend: LimiterBackend,
        *,
        tenant: str,
        tier: str,
        request_id: str,
        limits: Limits,
        reserve: int,
        fail_open: bool,
        sequences: int = 1,
        refusals: RefusalCache | None = None,
    ) -> "Admission":
        """`sequences`: what the concurrency lease weighs (n x prompts, the sequences the engine runs)."""
        if limits.unlimited:
            return cls(None, tenant, request_id, limits, None)
        wait_ms = tier_wait_ms = limits.max_queue_ms if limits.on_limit == "queue" else 0
        start = time.monotonic()
        finished = False  # the backend answered: it has left the queue itself
        try:
            decision = await backend.admit(
                tenant, request_id, limits, reserve, wait_ms=wait_ms, sequences=sequences
            )
            if decision.reason == "delivering" and wait_ms == 0:
                # Kept out only by streams the proxy is still delivering: the client may well have read
                # them already and sent this one at once. Wait for their acknowledgement, briefly.
                wait_ms = DELIVERY_GRACE_MS
                decision = await backend.admit(
                    tenant, request_id, limits, reserve, wait_ms=wait_ms, sequences=sequences
                )
            finished = True
        except LimiterUnavailable as error:
            # A call that timed out may still have admitted us over there: give any lease back, and keep
            # trying while the limiter is away, or that lease holds one of the tenant's slots until its TTL.
            with anyio.CancelScope(shield=True):
                await _release_or_retry(backend, tenant, request_id, 0, limits.lease_ttl_ms)
            if fail_open:
                log.warning("rate limiter unavailable, admitting (fail-open): %s", error)
                return cls(None, tenant, request_id, limits, None)
            _count_rejection(tenant, "unavailable")
            raise
        finally:
            if wait_ms > 0 and not finished:  # cancelled or failed mid-wait: never keep a place
                with anyio.CancelScope(shield=True):
                    await _quietly(backend.leave_queue(tenant, request_id))
        if decision.admitted:
            return cls(backend, tenant, request_id, limits, decision)
        if decision.reason == "delivering":  # still there after the grace: a client not reading them
            decision = dataclasses.replace(decision, reason="concurrency")
        _count_rejection(tenant, decision.reason or "requests")
        if refusals is not None:
            refusals.remember(tenant, decision, limits)
        if decision.reason == "too_large":
            raise RequestTooLarge(reserve, limits, tier)
        if decision.reason == "too_many_sequences":
            raise TooManySequences(sequences, concurrency_limit(limits, tier))
        waited = int((time.monotonic() - start) * 1000) if decision.reason != "queue_full" else 0
        raise RateLimited(decision, limits, tier, queued_ms=waited if tier_wait_ms > 0 else 0)

    @staticmethod
    async def count_refused(
        backend: LimiterBackend,
        *,
        tenant: str,
        request_id: str,
        limits: Limits,
        refusals: RefusalCache | None = None,
    ) -> None:
        """A request refused for its own input (a 400) still costs the tenant one request per minute, so a
        flood of bad requests is throttled like any other: once over its RPM, `refusals` keeps that, and
        the tenant's next requests are refused before their bodies are parsed. Best effort: it never
        changes this request's answer."""
        if limits.rpm is None:
            return
        try:
            decision = await backend.admit(tenant, request_id, limits, 0)
            if decision.admitted:
                await backend.release(tenant, request_id, 0)
            elif refusals is not None:
                refusals.remember(tenant, decision, limits)
        except Exception as error:  # the limiter is away: the refusal stands all the same
            log.debug("counting refused request %s failed: %s", request_id, error)

    @property
    def max_gpu_ms(self) -> float | None:
        """The GPU time its hold covers, which the engine must stop it at (None: no bound)."""
        return None if self.hold is None else self.hold.max_gpu_ms

    def headers(self) -> dict[str, str]:
        rate = {} if self.decision is None else self.decision.headers()
        return rate if self.hold is None else {**rate, **self.hold.headers()}

    def renew_every_s(self) -> float | None:
        """How often the timer renews: a third of the shorter TTL of what it holds (None: holds nothing)."""
        ttls = []
        if self.backend is not None and not self._released:
            ttls.append(self.limits.lease_ttl_ms)
        if self.guard is not None and self.hold is not None and self.hold.amount is not None:
            ttls.append(self.guard.hold_ttl_ms)
        return None if not ttls else min(ttls) / 1000 / RENEWALS_PER_TTL

    def _start_renewing(self) -> None:
        every = self.renew_every_s()
        if every is not None and self._renewer is None:
            # The timer holds the admission weakly: one its request dropped without releasing is not kept
            # alive by it (its lease and hold then lapse, as they would have anyway).
            self._renewer = asyncio.ensure_future(_renew_while_held(weakref.ref(self), every))

    def _stop_renewing(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            self._renewer = None

    async def renew(self) -> None:
        """Push the lease's and the hold's expiry back; a failure is logged, the next tick tries again."""
        if self.backend is not None and not self._released:
            await _quietly(self.backend.renew(self.tenant, self.request_id, self.limits))
        if self.guard is not None and self.hold is not None:
            await _quietly(self.guard.renew(self.hold))

    async def settle(self, used: Metered | None) -> Decimal | None:
        """Spend the request's metered cost (None: nothing ran) and release the rest of its hold; returns
        the cost, fixed now for its usage row (None when it was never priced). Once; shielded."""
        hold, self.hold = self.hold, None
        if self.guard is None or hold is None:
            return None
        with anyio.CancelScope(shield=True):  # a `with` may swallow, for mypy: the return comes after it
            cost = await self.guard.settle(hold, used)
        return cost  # noqa: RET504

    async def release(self, used_tokens: int) -> None:
        """Free the concurrency lease and reconcile the tokens (and settle a hold not settled yet, at
        nothing). Shielded: it runs on cancellation too."""
        self._stop_renewing()
        if self.hold is not None:
            await self.settle(None)
        if self.backend is None or self._released:
            return
        self._released = True
        with anyio.CancelScope(shield=True):
            await _release_or_retry(
                self.backend, self.tenant, self.request_id, used_tokens, self.limits.lease_ttl_ms
            )

    async def delivering(self) -> None:
        """The request's output is all written: its lease waits only for the proxy to deliver it, and a
        request of the tenant's that it alone keeps out waits for it briefly instead of being refused.
        Best effort: without the mark, that request is refused as before."""
        if self.backend is None or self._released:
            return
        with anyio.CancelScope(shield=True):
            await _quietly(self.backend.deliver(self.tenant, self.request_id))

    async def abandon(self) -> None:
        """Release the lease but leave the hold unsettled, to lapse or be replaced by the next hold under
        the same request id (a batch line whose runner stopped runs again and is charged then, once)."""
        self.hold = None
        await self.release(0)


async def _release_or_retry(
    backend: LimiterBackend, tenant: str, request_id: str, used_tokens: int, lease_ttl_ms: int
) -> None:
    """Release a lease; when the limiter is away, keep trying in the background (the lease holds one of
    the tenant's slots until then)."""
    try:
        await backend.release(tenant, request_id, used_tokens)
    except Exception as error:
        log.warning("releasing %s failed, retrying in the background: %s", request_id, error)
        # Past the lease's life the limiter has expired it: nothing is left to release.
        retry_in_background(
            lambda: backend.release(tenant, request_id, used_tokens),
            what=f"releasing {request_id}",
            within_s=lease_ttl_ms / 1000,
            max_wait_s=5.0,
            gave_up="its lease has expired by now",
        )


async def _renew_while_held(ref: "weakref.ref[Admission]", every: float) -> None:
    """The admission's renewal timer, until its release cancels it (or nothing is left to renew)."""
    while True:
        await asyncio.sleep(every)
        admission = ref()
        if admission is None or admission.renew_every_s() is None:
            return
        await admission.renew()
        del admission  # not kept alive across the sleep


def refused_before_parsing(
    refusals: RefusalCache, *, tenant: str, tier: str, limits: Limits
) -> RateLimited | None:
    """The 429 to answer at once if `tenant` was refused for its requests per minute a moment ago (the same
    error and hints as the limiter's, aged), or None: the request goes on to be parsed and admitted."""
    if limits.unlimited or limits.rpm is None:
        return None
    decision = refusals.refusal(tenant, limits)
    if decision is None:
        return None
    _count_rejection(tenant, "requests")
    return RateLimited(decision, limits, tier)


def concurrency_limit(limits: Limits, tier: str) -> str:
    """The tier's concurrency, as a refusal for too many sequences names it."""
    return f"tier {tier} runs at most {limits.max_concurrent} sequences at once"


def _count_rejection(tenant: str, reason: str) -> None:
    try:
        REJECTIONS.inc({"tenant": tenant, "reason": reason})
    except Exception:  # metrics must never change a decision
        log.exception("counting a limiter rejection failed")


async def _quietly(call: "asyncio.Future[None] | object") -> None:
    """Release-side calls must not turn a finished request into an error; the lease expires anyway."""
    try:
        await call  # type: ignore[misc]
    except Exception as error:
        log.warning("rate limiter release-side call failed (the lease will expire): %s", error)
