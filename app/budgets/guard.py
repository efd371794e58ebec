"""BudgetGuard: a request's money, from its reservation at admission to its settlement when it ends.

At admission the request's worst case (every prompt token at the dearer input price, every choice of
every prompt its max_tokens of output and, where GPU time is priced, the GPU-time bound the engine stops the
request at) is held against the tenant's credit and hard spend limits in the
shared budget backend, atomically there, so concurrent requests on any number of ingress replicas can
never together be served more than the tenant has. When the request ends it settles to its metered cost
at the same prices (never more than it held), and the rest is released. A backend that lost its state
answers `not_loaded` and the tenant is loaded again from the database first; a backend that cannot be
reached refuses a budgeted tenant's request with a 503 whatever the rate limiter's fail_open: budgets fail
closed. Tenants without credit or limits reserve nothing, but their requests are still priced: every
usage row's cost is fixed when it settles.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from app.background_retry import retry_in_background
from app.budgets.price_cache import PriceCache
from app.budgets.protocol import SETTLED_MEMORY_MS, BudgetBackend, BudgetView, Hold, Periods
from app.errors import BudgetUnavailable, InsufficientQuota
from billing import credit
from billing.micros import from_micros, to_micros
from billing.price_book import Metered, cost_of, worst_case
from billing.pricing import Prices

log = logging.getLogger(__name__)
DEFAULT_MAX_GPU_S = 300.0  # Settings.budget_max_gpu_seconds
HOLD_TTL_MS = 120_000  # a hold nobody renews (its request's timer, every third of this) or settles lapses
# A settle that failed is retried this long: past the hold's life (a lapsed hold is still charged) but
# within the backend's memory of settled ids, so an attempt that landed unseen is never charged twice.
SETTLE_RETRY_S = SETTLED_MEMORY_MS / 1000 * 0.9
LOAD_TRIES = 3  # snapshots read before giving up: each retry follows a credit that committed after the read
_LIMIT_NAMES = {"credit": "prepaid credit", "day": "daily spend limit", "month": "monthly spend limit"}


def periods_at(moment: datetime | None = None) -> Periods:
    moment = moment or datetime.now(UTC)
    return Periods(day=credit.period_key("day", moment), month=credit.period_key("month", moment))


@dataclass(frozen=True)
class BudgetHold:
    """What admission took for one request: the prices it runs at, and what it holds (None: nothing)."""

    tenant_id: str
    request_id: str
    prices: Prices
    amount: int | None
    view: BudgetView | None
    # The GPU time (ms) the engine may charge the request (EngineRequest.max_gpu_ms), part of `amount`;
    # None: not bounded (the tenant is not budgeted, or its prices do not charge GPU time).
    max_gpu_ms: float | None = None

    def headers(self) -> dict[str, str]:
        remaining = None if self.view is None else self.view.remaining()
        if remaining is None:
            return {}
        return {
            "x-budget-remaining": str(from_micros(max(0, remaining))),
            "x-budget-currency": self.prices.currency,
        }


class BudgetGuard:
    def __init__(
        self,
        backend: BudgetBackend,
        session_factory: Callable[[], Session],
        *,
        price_ttl_s: float,
        max_gpu_seconds: float = DEFAULT_MAX_GPU_S,
        hold_ttl_ms: int | None = None,
    ) -> None:
        """`max_gpu_seconds`: the GPU time a budgeted request may use where GPU time is priced; its hold
        includes that much, and the engine stops the request there. `hold_ttl_ms` (HOLD_TTL_MS): how long
        a hold lives unless renewed; its request's admission renews it every third of that."""
        self.backend = backend
        self.hold_ttl_ms = HOLD_TTL_MS if hold_ttl_ms is None else hold_ttl_ms
        self.max_gpu_ms = max_gpu_seconds * 1000
        self._sessions = session_factory
        self.prices = PriceCache(session_factory, ttl_s=price_ttl_s)
        self._soft_written: set[tuple[str, str]] = set()  # (tenant, period key) this replica has written

    async def hold(
        self,
        *,
        tenant_id: str,
        budgeted: bool,
        request_id: str,
        base_model: str,
        adapter_id: str | None,
        prompt_tokens: int,
        output_tokens: int,
        price_factor: Decimal = Decimal(1),
    ) -> BudgetHold:
        """Reserve the request's worst case, or raise InsufficientQuota (429) / BudgetUnavailable (503).
        `price_factor`: the request's prices are the tier's times this (a batch line's)."""
        try:
            prices = (await self.prices.get(tenant_id, base_model, adapter_id)).times(price_factor)
        except Exception:
            log.exception("reading the prices of %s failed", tenant_id)
            raise BudgetUnavailable() from None
        if not budgeted:
            return BudgetHold(tenant_id, request_id, prices, None, None)
        max_gpu_ms = self.max_gpu_ms if prices.gpu_per_second > 0 else None
        amount = to_micros(worst_case(prompt_tokens, output_tokens, prices, max_gpu_ms))
        periods = periods_at()
        try:
            hold = await self.backend.reserve(tenant_id, request_id, amount, self.hold_ttl_ms, periods)
            if hold.reason == "not_loaded":
                await self.load(tenant_id)
                hold = await self.backend.reserve(tenant_id, request_id, amount, self.hold_ttl_ms, periods)
        except Exception as error:  # the backend or the database is away: fail closed
            log.warning("budget check for %s failed, refusing: %s", request_id, error)
            raise BudgetUnavailable() from None
        if not hold.admitted:
            raise self._refusal(hold, amount, prices)
        assert hold.view is not None
        await self._soft_events(tenant_id, hold.view, periods)
        return BudgetHold(tenant_id, request_id, prices, amount, hold.view, max_gpu_ms)

    def sessions(self) -> Session:
        return self._sessions()

    async def load(self, tenant_id: str) -> None:
        """Load the tenant from the database. A backend that saw a credit notice newer than the snapshot
        refuses it (the entry committed after the read); the next read has it."""
        for _ in range(LOAD_TRIES):
            snapshot = await run_in_threadpool(self._snapshot, tenant_id)
            if await self.backend.load(snapshot, snapshot.version):
                return
        log.warning("%s's budget snapshot stayed older than its credit notices, refusing", tenant_id)
        raise BudgetUnavailable()  # fail closed

    def _snapshot(self, tenant_id: str) -> credit.BudgetSnapshot:
        with self._sessions() as session:
            return credit.snapshot(session, tenant_id=tenant_id)

    @staticmethod
    def _refusal(hold: Hold, amount: int, prices: Prices) -> InsufficientQuota:
        reason = hold.reason or "credit"
        remaining = 0 if hold.view is None else max(0, hold.view.remaining() or 0)
        headers = {"x-budget-remaining": str(from_micros(remaining)), "x-budget-currency": prices.currency}
        return InsufficientQuota(
            _LIMIT_NAMES.get(reason, "budget"),
            needed=str(from_micros(amount)),
            remaining=str(from_micros(remaining)),
            currency=prices.currency,
            headers=headers,
        )

    async def _soft_events(self, tenant_id: str, view: BudgetView, periods: Periods) -> None:
        """A soft limit passed: one budget event per tenant and period (the database keeps it unique)."""
        for period in view.soft_over():
            key = periods.day if period == "day" else periods.month
            if (tenant_id, key) in self._soft_written:
                continue
            self._soft_written.add((tenant_id, key))
            amount = from_micros(view.limits[period][0])
            detail = f"spend passed the soft {period} limit of {amount}"
            try:
                await run_in_threadpool(self._write_event, tenant_id, key, detail)
            except Exception:  # a warning must never refuse a request
                log.exception("writing the soft-limit event of %s failed", tenant_id)
                self._soft_written.discard((tenant_id, key))

    def _write_event(self, tenant_id: str, key: str, detail: str) -> None:
        with self._sessions() as session, session.begin():
            credit.record_event(
                session, tenant_id=tenant_id, period_key=key, kind="soft_limit", detail=detail
            )

    async def settle(self, hold: BudgetHold, used: Metered | None) -> Decimal:
        """The request's cost at its admission's prices (0 when nothing ran), spent in the backend: the
        amount its usage row records, to the micro-unit. A backend that is away gets it from a background
        retry until it lands (settling is idempotent per request id); the response never waits on it."""
        cost = Decimal("0.000000") if used is None else cost_of(used, hold.prices)
        if hold.amount is None:
            return cost
        # The engine charges at most max_gpu_ms, so the cost is within the hold; the cap keeps the promise
        # even against an engine that ignored the bound (one of an older version, mid-upgrade), and the row
        # says what was spent, so a reload from the rows finds the balance the backend had.
        micros = min(to_micros(cost), hold.amount)
        try:
            await self.backend.settle(hold.tenant_id, hold.request_id, micros, periods_at())
        except Exception as error:
            log.warning("settling %s failed, retrying in the background: %s", hold.request_id, error)
            # Past the hold's life too (a lapsed hold is charged all the same): until this lands the live
            # balance counts the request as neither held nor spent.
            retry_in_background(
                lambda: self.backend.settle(hold.tenant_id, hold.request_id, micros, periods_at()),
                what=f"settling {hold.request_id}",
                within_s=SETTLE_RETRY_S,
                max_wait_s=10.0,
                gave_up="the live balance misses its cost until its tenant is reloaded from the usage rows",
                gave_up_level=logging.ERROR,
            )
        return from_micros(micros)

    async def drop(self, tenant_id: str, request_id: str) -> None:
        """Free, at nothing, a hold its request left unsettled for a retry that will not come (a batch line
        that failed for good: `Admission.abandon`); without this it stays reserved until it lapses. Best
        effort: a backend that is away lets it lapse."""
        try:
            await self.backend.settle(tenant_id, request_id, 0, periods_at())
        except Exception as error:
            log.warning("dropping the hold of %s failed, it lapses: %s", request_id, error)

    async def spend(self, tenant_id: str, request_id: str, cost: Decimal) -> None:
        """A charge with no request in flight (an hour's storage): settled as a request is, once per id; a
        tenant not loaded counts it from its usage row when it loads."""
        await self.backend.settle(tenant_id, request_id, to_micros(cost), periods_at())

    async def renew(self, hold: BudgetHold) -> None:
        if hold.amount is not None:
            await self.backend.renew(hold.tenant_id, hold.request_id, self.hold_ttl_ms)

    async def view(self, tenant_id: str) -> BudgetView | None:
        """The tenant's budget now (loaded first if the backend has not got it)."""
        periods = periods_at()
        view = await self.backend.peek(tenant_id, periods)
        if view is None:
            await self.load(tenant_id)
            view = await self.backend.peek(tenant_id, periods)
        return view
