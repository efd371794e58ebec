"""BudgetGuard's GPU-time bound (issue 29): where a tenant's prices charge GPU time, a budgeted request's
hold includes max_gpu_seconds of it, the hold names that bound for the engine (which charges at most it),
and no usage within the bounds settles above the hold, on the local and the Redis backend. And a hold and
its lease live as long as their request (issue 35, item 5): renewed by a timer whether or not output
arrives, and a settle that fails past the hold's life lands later, the usage row's amount exactly."""

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from decimal import Decimal

import pytest
from sqlalchemy.orm import Session, sessionmaker

from app.budgets import guard as guard_module
from app.budgets.guard import BudgetGuard, BudgetHold, periods_at
from app.budgets.local_backend import LocalBudgets
from app.budgets.protocol import BudgetBackend
from app.budgets.redis_backend import RedisBudgets
from app.completions.admission import Admission, BudgetAsk
from app.errors import InsufficientQuota
from app.limits import LimiterUnavailable, Limits
from app.limits.local_backend import LocalLimiter
from billing import credit, repository
from billing.db import make_engine, make_session_factory
from billing.micros import from_micros, to_micros
from billing.migrate import upgrade
from billing.price_book import Metered, cost_of, worst_case
from billing.pricing import Prices

MODEL = "tiny"
PROMPT, OUTPUT = 30, 50
GPU_S = 2.5  # the bound: 2.5 GPU seconds a request


@pytest.fixture
def sessions(sqlite_url: str) -> Iterator[sessionmaker[Session]]:
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    factory = make_session_factory(engine)
    with factory() as s, s.begin():
        repository.create_tier(s, name="gpu", price_input_per_mtok="3", price_cached_input_per_mtok="1",
                               price_output_per_mtok="15", price_gpu_per_second="0.0137")  # fmt: skip
        repository.create_tier(s, name="tokens", price_input_per_mtok="3", price_output_per_mtok="15")
    yield factory
    engine.dispose()


@pytest.fixture(params=["local", "redis"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[BudgetBackend]:
    if request.param == "local":
        yield LocalBudgets()
        return
    redis_backend = RedisBudgets(request.getfixturevalue("redis_url"), key_prefix=f"t:{uuid.uuid4().hex}")
    try:
        yield redis_backend
    finally:
        await redis_backend.aclose()


def tenant(sessions: sessionmaker[Session], tier: str, credit_amount: str | None) -> str:
    with sessions() as s, s.begin():
        tenant_id = repository.create_tenant(s, name=f"t-{uuid.uuid4().hex[:8]}", tier=tier).id
        if credit_amount is not None:
            credit.add_credit(
                s, tenant_id=tenant_id, amount=credit_amount, kind="topup", reason="t", actor="t"
            )
    return tenant_id


async def hold(guard: BudgetGuard, tenant_id: str, *, budgeted: bool = True) -> BudgetHold:
    return await guard.hold(tenant_id=tenant_id, budgeted=budgeted, request_id=f"r-{uuid.uuid4().hex}",
                            base_model=MODEL, adapter_id=None, prompt_tokens=PROMPT,
                            output_tokens=OUTPUT)  # fmt: skip


async def test_the_hold_includes_the_gpu_bound_only_where_gpu_time_is_priced(
    sessions: sessionmaker[Session], backend: BudgetBackend
) -> None:
    guard = BudgetGuard(backend, sessions, price_ttl_s=0, max_gpu_seconds=GPU_S)
    gpu_held = await hold(guard, tenant(sessions, "gpu", "10"))
    tokens_only = worst_case(PROMPT, OUTPUT, gpu_held.prices)
    assert gpu_held.max_gpu_ms == GPU_S * 1000
    # 2.5 s at 0.0137 a second: 0.03425 on top of the tokens' worst case
    assert gpu_held.amount == to_micros(tokens_only) + 34_250

    tokens_held = await hold(guard, tenant(sessions, "tokens", "10"))
    assert tokens_held.max_gpu_ms is None  # GPU time is free here: the engine is not bounded
    assert tokens_held.amount == to_micros(worst_case(PROMPT, OUTPUT, tokens_held.prices))

    unbudgeted = await hold(guard, tenant(sessions, "gpu", None), budgeted=False)
    assert (unbudgeted.amount, unbudgeted.max_gpu_ms) == (None, None)


async def test_credit_for_the_tokens_but_not_the_gpu_bound_is_refused(
    sessions: sessionmaker[Session], backend: BudgetBackend
) -> None:
    guard = BudgetGuard(backend, sessions, price_ttl_s=0, max_gpu_seconds=GPU_S)
    prices = await guard.prices.get(tenant(sessions, "gpu", None), MODEL, None)
    enough_for_tokens = worst_case(PROMPT, OUTPUT, prices) + Decimal("0.01")  # < the GPU part (0.03425)
    with pytest.raises(InsufficientQuota):
        await hold(guard, tenant(sessions, "gpu", str(enough_for_tokens)))


def usages_within_the_bounds(max_gpu_ms: float) -> list[Metered]:
    """Every extreme the engine can report: no, some and all tokens cached, GPU time up to the bound
    (what it charges at most: usage_of's min), a double just under it that rounds up to it."""
    under = max_gpu_ms * (1 - 1e-12)
    return [
        Metered(p, c, o, g)
        for p in (0, PROMPT)
        for c in {0, p // 2, p}
        for o in (0, OUTPUT)
        for g in (0.0, 0.4, under, max_gpu_ms)
    ]


async def test_no_usage_within_the_bounds_settles_above_the_hold(
    sessions: sessionmaker[Session], backend: BudgetBackend
) -> None:
    guard = BudgetGuard(backend, sessions, price_ttl_s=0, max_gpu_seconds=GPU_S)
    tenant_id = tenant(sessions, "gpu", "10")
    for used in usages_within_the_bounds(GPU_S * 1000):
        held = await hold(guard, tenant_id)
        assert held.amount is not None and held.max_gpu_ms is not None
        before = await backend.peek(tenant_id, periods_at())
        cost = await guard.settle(held, used)
        after = await backend.peek(tenant_id, periods_at())
        assert before is not None and after is not None
        assert to_micros(cost) <= held.amount, used
        # spent in full, not capped: the backend's spend is the usage rows' cost, to the micro-unit
        assert before.balance is not None and after.balance is not None
        assert before.balance - after.balance == to_micros(cost), used
        assert cost == cost_of(used, held.prices)


async def test_an_engine_past_its_bound_is_still_settled_at_most_the_hold(
    sessions: sessionmaker[Session], backend: BudgetBackend
) -> None:
    """An engine that ignored the bound (an older one, mid-upgrade): the row says what it cost, the
    backend spends no more than was held."""
    guard = BudgetGuard(backend, sessions, price_ttl_s=0, max_gpu_seconds=GPU_S)
    tenant_id = tenant(sessions, "gpu", "10")
    held = await hold(guard, tenant_id)
    assert held.amount is not None
    cost = await guard.settle(held, Metered(PROMPT, 0, OUTPUT, GPU_S * 1000 * 3))
    view = await backend.peek(tenant_id, periods_at())
    assert view is not None and view.balance is not None
    assert to_micros(cost_of(Metered(PROMPT, 0, OUTPUT, GPU_S * 1000 * 3), held.prices)) > held.amount
    assert from_micros(view.balance) == Decimal("10") - from_micros(held.amount)
    assert cost == from_micros(held.amount)  # the usage row says what the backend spent


def test_worst_case_counts_gpu_time_as_cost_of_does() -> None:
    prices = Prices(tier="t", currency="usd", input_per_mtok=Decimal("0"), cached_input_per_mtok=Decimal("0"),
                    output_per_mtok=Decimal("0"), gpu_per_second=Decimal("0.333333"))  # fmt: skip
    for bound in (0.001, 1.0000005, 999.9995, 2500.0):
        expected = cost_of(Metered(0, 0, 0, bound), prices) + Decimal("0.000002")
        assert worst_case(0, 0, prices, bound) == expected
    assert worst_case(0, 0, prices) == Decimal("0.000002")  # no bound: GPU time is not counted


SHORT_TTL_MS = 300  # the hold's and the lease's life here: the request below outlives it three times over


async def test_a_request_without_output_keeps_its_hold_and_its_lease(
    sessions: sessionmaker[Session], backend: BudgetBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request waiting longer than the TTLs without any output (a long engine queue, a long prefill):
    its money and its concurrency slot stay taken, so a second request is refused both meanwhile."""
    monkeypatch.setattr(guard_module, "HOLD_TTL_MS", SHORT_TTL_MS)
    guard = BudgetGuard(backend, sessions, price_ttl_s=0)
    tenant_id = tenant(sessions, "tokens", "0.001")  # one request's worst case (0.000842), not two
    limiter, limits = LocalLimiter(), Limits(max_concurrent=1, lease_ttl_ms=SHORT_TTL_MS)
    ask = BudgetAsk(guard, True, MODEL, None, PROMPT, OUTPUT)
    first = await Admission.acquire(
        limiter, tenant=tenant_id, tier="tokens", request_id="first", limits=limits, reserve=10,
        fail_open=False, budget=ask,
    )  # fmt: skip
    await asyncio.sleep(SHORT_TTL_MS / 1000 * 3.5)  # no output, so nothing renews but the timer
    with pytest.raises(InsufficientQuota):
        await hold(guard, tenant_id)
    assert not (await limiter.admit(tenant_id, "second", limits, 10)).admitted
    await first.settle(Metered(PROMPT, 0, 1, 0.0))
    await first.release(PROMPT + 1)
    second = await Admission.acquire(
        limiter, tenant=tenant_id, tier="tokens", request_id="second", limits=limits, reserve=10,
        fail_open=False, budget=ask,
    )  # fmt: skip
    await second.release(0)


async def test_a_settle_that_fails_past_the_holds_life_lands_later(
    sessions: sessionmaker[Session], backend: BudgetBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend is away when the request settles and for longer than its hold lives: the settle is
    retried until it lands, and the live balance then drops by exactly the usage row's cost."""
    monkeypatch.setattr(guard_module, "HOLD_TTL_MS", SHORT_TTL_MS)
    guard = BudgetGuard(backend, sessions, price_ttl_s=0)
    tenant_id = tenant(sessions, "tokens", "10")
    held = await hold(guard, tenant_id)
    loop = asyncio.get_running_loop()
    away_until = loop.time() + SHORT_TTL_MS / 1000 * 3
    settle = backend.settle

    async def flaky_settle(tenant: str, request_id: str, cost: int, periods: object) -> None:
        if loop.time() < away_until:
            raise LimiterUnavailable("connection refused")
        await settle(tenant, request_id, cost, periods)  # type: ignore[arg-type]

    monkeypatch.setattr(backend, "settle", flaky_settle)
    row_cost = await guard.settle(held, Metered(PROMPT, 0, 7, 0.0))  # fails: returns at once all the same
    assert row_cost > 0
    spent = Decimal(0)
    for _ in range(60):
        view = await backend.peek(tenant_id, periods_at())
        assert view is not None and view.balance is not None
        spent = Decimal("10") - from_micros(view.balance)
        if spent:
            break
        await asyncio.sleep(0.1)
    assert spent == row_cost


class _TopUpDuringLoad(LocalBudgets):
    """A backend whose first load comes after a top-up committed and its notice arrived: the snapshot in
    hand predates the entry (the race of issue 35, item 4)."""

    def __init__(self, sessions: sessionmaker[Session], tenant_id: str) -> None:
        super().__init__()
        self._sessions, self._tenant, self.loads = sessions, tenant_id, 0

    async def load(self, snapshot: credit.BudgetSnapshot, version: int) -> bool:
        self.loads += 1
        if self.loads == 1:
            with self._sessions() as s, s.begin():
                credit.add_credit(s, tenant_id=self._tenant, amount="4", kind="topup", reason="", actor="t")
                version_now = credit.credit_version(s, tenant_id=self._tenant)
            await self.credit(self._tenant, to_micros(Decimal(4)), version_now)
        return await super().load(snapshot, version)


async def test_a_top_up_landing_while_the_tenant_loads_is_counted(sessions: sessionmaker[Session]) -> None:
    """Before the fix the notice found no tenant and was dropped, and the load installed the older
    snapshot: the live balance said 1.00 where the ledger said 5.00 until the next reload."""
    tenant_id = tenant(sessions, "tokens", "1")
    backend = _TopUpDuringLoad(sessions, tenant_id)
    guard = BudgetGuard(backend, sessions, price_ttl_s=0)
    view = await guard.view(tenant_id)
    assert backend.loads == 2  # the stale snapshot was refused and a new one read
    assert view is not None and view.balance == to_micros(Decimal(5))
