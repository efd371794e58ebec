"""One behaviour for every BudgetBackend (issue 29): local (BudgetState in-process), Ray (the actor),
Redis (Lua). Top-up, reserve, settle, refuse, expiry, fail-closed loading and the race that must never
overshoot, each on all three."""

import asyncio
import uuid

from app.budgets.protocol import BudgetBackend, Periods
from billing.credit import BudgetSnapshot

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
