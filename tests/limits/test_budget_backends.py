"""One behaviour for every BudgetBackend (issue 29): local (BudgetState in-process), Ray (the actor),
Redis (Lua). Top-up, reserve, settle, refuse, expiry, fail-closed loading and the race that must never
overshoot, each on all three."""

import asyncio
import threading
import time
import uuid

import pytest
import redis
from sqlalchemy.orm import Session, sessionmaker

from app.budgets.protocol import BudgetBackend, Periods
from app.budgets.redis_backend import RedisBudgets
from billing import credit, repository
from billing.credit import BudgetSnapshot
from billing.micros import to_micros
from tests.limits.conftest import _delete_keys

TENANT = "acme"
TODAY = Periods(day="day:2026-11-27", month="month:2026-11")
TOMORROW = Periods(day="day:2026-11-28", month="month:2026-11")
TTL = 60_000


def rid() -> str:
    return f"req_{uuid.uuid4().hex}"


def snapshot(
    balance: int | None = 10_000_000, limits: dict[str, tuple[int, bool]] | None = None, spent_day: int = 0
) -> BudgetSnapshot:
    return BudgetSnapshot(tenant_id=TENANT, currency="usd", balance=balance, day_key=TODAY.day,
                          month_key=TODAY.month, spent_day=spent_day, spent_month=spent_day,
                          limits=limits or {})  # fmt: skip


async def test_unloaded_tenant_is_refused_until_loaded(budgets: BudgetBackend) -> None:
    hold = await budgets.reserve(TENANT, rid(), 1, TTL, TODAY)
    assert (hold.admitted, hold.reason) == (False, "not_loaded")
    assert await budgets.peek(TENANT, TODAY) is None
    await budgets.load(snapshot(), 1)
    assert (await budgets.reserve(TENANT, rid(), 1, TTL, TODAY)).admitted


async def test_reserve_then_settle_releases_the_rest(budgets: BudgetBackend) -> None:
    await budgets.load(snapshot(balance=1_000_000), 1)
    first = rid()
    hold = await budgets.reserve(TENANT, first, 600_000, TTL, TODAY)
    assert hold.admitted and hold.view is not None
    assert (hold.view.balance, hold.view.reserved, hold.view.remaining()) == (1_000_000, 600_000, 400_000)
    refused = await budgets.reserve(TENANT, rid(), 500_000, TTL, TODAY)
    assert (refused.admitted, refused.reason) == (False, "credit")
    await budgets.settle(TENANT, first, 150_000, TODAY)
    view = await budgets.peek(TENANT, TODAY)
    assert view is not None
    assert (view.balance, view.reserved, view.spent_day, view.spent_month) == (850_000, 0, 150_000, 150_000)
    assert (await budgets.reserve(TENANT, rid(), 500_000, TTL, TODAY)).admitted


async def test_settle_is_idempotent_and_charges_an_expired_hold(budgets: BudgetBackend) -> None:
    await budgets.load(snapshot(balance=1_000_000), 1)
    request = rid()
    assert (await budgets.reserve(TENANT, request, 500_000, 50, TODAY)).admitted
    await asyncio.sleep(0.15)  # the hold expired: its replica died, say
    assert (await budgets.reserve(TENANT, rid(), 900_000, TTL, TODAY)).admitted  # the money came back
    await budgets.settle(TENANT, request, 100_000, TODAY)  # its usage still arrives: charged all the same
    await budgets.settle(TENANT, request, 100_000, TODAY)  # a retried settle charges once
    view = await budgets.peek(TENANT, TODAY)
    assert view is not None and (view.balance, view.reserved) == (900_000, 900_000)


async def test_renewed_hold_outlives_its_first_ttl(budgets: BudgetBackend) -> None:
    await budgets.load(snapshot(balance=1_000_000), 1)
    request = rid()
    assert (await budgets.reserve(TENANT, request, 800_000, 300, TODAY)).admitted
    await budgets.renew(TENANT, request, TTL)
    await asyncio.sleep(0.4)
    refused = await budgets.reserve(TENANT, rid(), 300_000, TTL, TODAY)
    assert (refused.admitted, refused.reason) == (False, "credit")


async def test_hard_limit_refuses_and_soft_limit_only_warns(budgets: BudgetBackend) -> None:
    await budgets.load(snapshot(balance=None, limits={"day": (1_000, True), "month": (500, False)}), 0)
    hold = await budgets.reserve(TENANT, rid(), 800, TTL, TODAY)
    assert hold.admitted and hold.view is not None
    assert hold.view.balance is None and hold.view.soft_over() == ["month"]
    refused = await budgets.reserve(TENANT, rid(), 300, TTL, TODAY)
    assert (refused.admitted, refused.reason) == (False, "day")
    assert (await budgets.reserve(TENANT, rid(), 300, TTL, TOMORROW)).reason == "day"  # held still counts
    await budgets.set_limits(TENANT, {"day": (2_000, True)})
    assert (await budgets.reserve(TENANT, rid(), 300, TTL, TODAY)).admitted


async def test_a_new_day_starts_its_spend_at_zero(budgets: BudgetBackend) -> None:
    await budgets.load(snapshot(balance=None, limits={"day": (1_000, True)}, spent_day=900), 0)
    assert (await budgets.reserve(TENANT, rid(), 200, TTL, TODAY)).reason == "day"
    hold = await budgets.reserve(TENANT, rid(), 200, TTL, TOMORROW)
    assert hold.admitted and hold.view is not None and hold.view.spent_day == 0


async def test_top_up_lands_once_and_load_never_overwrites_live_state(budgets: BudgetBackend) -> None:
    await budgets.load(snapshot(balance=100), 1)
    await budgets.settle(TENANT, rid(), 40, TODAY)
    await budgets.load(snapshot(balance=100), 1)  # a second replica's snapshot: older than the live state
    await budgets.credit(TENANT, 1_000, 2)
    await budgets.credit(TENANT, 1_000, 2)  # the same entry again
    await budgets.credit(TENANT, 1_000, 1)  # one the snapshot had already counted
    view = await budgets.peek(TENANT, TODAY)
    assert view is not None and view.balance == 1_060


async def test_forgotten_tenant_fails_closed(budgets: BudgetBackend) -> None:
    await budgets.load(snapshot(), 1)
    await budgets.forget(TENANT)  # what a restarted limiter looks like
    assert (await budgets.reserve(TENANT, rid(), 1, TTL, TODAY)).reason == "not_loaded"


async def test_concurrent_reservations_never_overshoot(budgets: BudgetBackend) -> None:
    """400 requests at once, credit for 25 of them: exactly 25 are admitted, whatever the interleaving."""
    await budgets.load(snapshot(balance=25 * 1_000), 1)
    holds = await asyncio.gather(*(budgets.reserve(TENANT, rid(), 1_000, TTL, TODAY) for _ in range(400)))
    assert sum(h.admitted for h in holds) == 25
    assert {h.reason for h in holds if not h.admitted} == {"credit"}


async def test_credit_notices_land_once_each_in_any_order(budgets: BudgetBackend) -> None:
    """Issue 35, item 4: notices come from different replicas, so they race. The probe: -50 then +10
    delivered in reverse left +10 where the database said -40, and admitted a 5.00 reservation."""
    await budgets.load(snapshot(balance=0), 0)
    await budgets.credit(TENANT, 10_000_000, 2)  # the second entry's notice arrives first
    await budgets.credit(TENANT, -50_000_000, 1)
    await budgets.credit(TENANT, 10_000_000, 2)  # each again: counted once
    await budgets.credit(TENANT, -50_000_000, 1)
    view = await budgets.peek(TENANT, TODAY)
    assert view is not None and view.balance == -40_000_000
    refused = await budgets.reserve(TENANT, rid(), 5_000_000, TTL, TODAY)
    assert (refused.admitted, refused.reason) == (False, "credit")
    for delta, version in [(30_000_000, 5), (20_000_000, 4), (30_000_000, 5), (5_000_000, 3)]:
        await budgets.credit(TENANT, delta, version)  # a gap of two, filled late
    view = await budgets.peek(TENANT, TODAY)
    assert view is not None and view.balance == 15_000_000
    assert (await budgets.reserve(TENANT, rid(), 5_000_000, TTL, TODAY)).admitted


def _two_writers(sessions: sessionmaker[Session], tenant_id: str) -> list[tuple[int, int]]:
    """A -50.00 adjustment and a +10.00 top-up written at once, the second while the first's transaction is
    open: (delta, version) of each, in the order they committed."""
    written: list[tuple[int, int]] = []
    first_open = threading.Event()

    def write(amount: str, kind: credit.Kind, hold: bool) -> None:
        with sessions() as s, s.begin():
            entry = credit.add_credit(
                s, tenant_id=tenant_id, amount=amount, kind=kind, reason="", actor="ops"
            )
            version = credit.credit_version(s, tenant_id=tenant_id)
            if hold:
                first_open.set()
                time.sleep(0.5)  # the other writer is inside its transaction meanwhile, waiting
            written.append((to_micros(entry.amount), version))

    def second_writer() -> None:
        first_open.wait(10)
        write("10", "topup", False)

    second = threading.Thread(target=second_writer)
    second.start()
    write("-50", "adjustment", True)
    second.join(10)
    return written


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
async def test_two_writers_on_postgresql_and_reordered_notices_land_once(
    budgets: BudgetBackend, session_factory: sessionmaker[Session]
) -> None:
    """Issue 35, item 4: two concurrent entries get distinct versions (allocated under the tenant's lock),
    and their notices, delivered in reverse, leave the live balance where the database says it is."""
    with session_factory() as s, s.begin():
        tenant_id = repository.create_tenant(s, name="acme").id
        credit.add_credit(s, tenant_id=tenant_id, amount="5", kind="topup", reason="", actor="ops")
    with session_factory() as s:
        await budgets.load(credit.snapshot(s, tenant_id=tenant_id), 1)
    written = await asyncio.to_thread(_two_writers, session_factory, tenant_id)
    assert sorted(version for _, version in written) == [2, 3]
    for delta, version in reversed(written):
        await budgets.credit(tenant_id, delta, version)
    with session_factory() as s:
        truth = credit.snapshot(s, tenant_id=tenant_id)
    view = await budgets.peek(tenant_id, TODAY)
    assert truth.balance == -35_000_000 and view is not None and view.balance == truth.balance
    refused = await budgets.reserve(tenant_id, rid(), 5_000_000, TTL, TODAY)
    assert (refused.admitted, refused.reason) == (False, "credit")


async def test_redis_budgets_survive_a_pooled_connection_that_died(redis_url: str) -> None:
    """A Redis restart leaves pooled connections dead but looking open; the next budget call must not
    fail on one (it did: the load test's first request after a Redis outage got a 503)."""
    prefix = f"loraplex-test:{uuid.uuid4().hex}"
    budgets = RedisBudgets(redis_url, key_prefix=prefix)
    killer = redis.Redis.from_url(redis_url)
    try:
        await budgets.load(snapshot(balance=1_000_000), 1)
        pooled = await budgets._redis.client_id()  # the pool's one idle connection, as the server knows it
        assert killer.client_kill_filter(_id=str(pooled)) == 1  # the server drops it; the pool does not know
        hold = await budgets.reserve(TENANT, rid(), 1_000, TTL, TODAY)
        assert hold.admitted and hold.view is not None and hold.view.reserved == 1_000
    finally:
        killer.close()
        await budgets.aclose()
        _delete_keys(redis_url, prefix)


async def test_a_credit_noticed_before_its_tenant_loads_is_not_lost(budgets: BudgetBackend) -> None:
    """Issue 35, item 4: a load reads its snapshot, a top-up commits and its notice arrives while the
    tenant is not loaded yet, then the load installs the older snapshot. The backend refuses it, and the
    next snapshot (which has the entry) is taken: the entry lands once."""
    await budgets.credit(TENANT, 10_000_000, 2)  # the tenant is not loaded: nothing to add it to
    assert not await budgets.load(snapshot(balance=0), 1)  # read before entry 2 committed: refused
    assert await budgets.peek(TENANT, TODAY) is None
    assert await budgets.load(snapshot(balance=10_000_000), 2)
    await budgets.credit(TENANT, 10_000_000, 2)  # the notice again: counted once
    view = await budgets.peek(TENANT, TODAY)
    assert view is not None and view.balance == 10_000_000
    assert await budgets.load(snapshot(balance=0), 1)  # loaded already: the live state stays
    view = await budgets.peek(TENANT, TODAY)
    assert view is not None and view.balance == 10_000_000


async def test_a_first_top_up_is_not_lost_to_a_postpaid_snapshot_in_flight(budgets: BudgetBackend) -> None:
    """A postpaid tenant's first top-up makes it prepaid: the backend drops its state, and a load that
    read the postpaid snapshot before the top-up must not install it (it would admit on no balance)."""
    assert await budgets.load(snapshot(balance=None), 0)
    await budgets.credit(TENANT, 3_000_000, 1)
    assert await budgets.peek(TENANT, TODAY) is None
    await budgets.forget(TENANT)  # forgetting the tenant keeps the notice's mark
    assert not await budgets.load(snapshot(balance=None), 0)
    assert await budgets.load(snapshot(balance=3_000_000), 1)
    refused = await budgets.reserve(TENANT, rid(), 4_000_000, TTL, TODAY)
    assert (refused.admitted, refused.reason) == (False, "credit")
