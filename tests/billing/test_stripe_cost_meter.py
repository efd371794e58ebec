"""The Stripe export's monetary meter and prepaid tenants (issue 29), against the Stripe stub, on both
backends: each closed rollup's settled cost (the sum of its usage rows' costs, at our prices when each ran)
goes to the cost meter in micro-units, exactly once, late usage as the increase only; a prepaid tenant's
usage from the hour of its first credit entry on is never sent to any meter, and the log accounts for it."""

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from bench.stripe_stub import StripeStub
from billing import credit, repository
from billing.db import session_scope
from billing.micros import to_micros
from billing.models import CreditEntry, Tenant, UsageEvent, UsageRollup
from billing.price_book import Metered, cost_of, set_prices
from billing.pricing import Prices
from billing.stripe_export import PREPAID, make_client, reconcile
from billing.usage import UsageRecord, closed_before, hour_of
from tests.billing.test_stripe_export import METER, add_usage, config, exports, no_duplicates, run, usage

TIER = Prices(tier="metered", currency="usd", input_per_mtok=Decimal(3), cached_input_per_mtok=Decimal(1),
              output_per_mtok=Decimal(15), gpu_per_second=Decimal("0.0137"))  # fmt: skip
ACME = replace(TIER, output_per_mtok=Decimal(9))  # acme's own price: it must reach acme's invoice


def priced(record: UsageRecord, prices: Prices) -> UsageRecord:
    """The record as the ingress settles it: its cost fixed at the prices it was admitted at."""
    used = Metered(record.prompt_tokens, record.cached_tokens, record.completion_tokens, record.gpu_ms)
    return replace(record, cost=str(cost_of(used, prices)), currency=prices.currency)


@pytest.fixture
def sessions(session_factory: sessionmaker[Session]) -> sessionmaker[Session]:
    with session_scope(session_factory) as s:
        repository.create_tier(s, name="metered", price_input_per_mtok="3", price_cached_input_per_mtok="1",
                               price_output_per_mtok="15", price_gpu_per_second="0.0137")  # fmt: skip
        for tenant, customer in (("ten_post", "cus_post"), ("ten_acme", "cus_acme"), ("ten_pre", "cus_pre")):
            s.add(Tenant(id=tenant, name=tenant, tier="metered", stripe_customer_id=customer))
        s.flush()
        set_prices(s, tenant_id="ten_acme", prices=ACME, effective_from=datetime(2000, 1, 1, tzinfo=UTC))
    return session_factory


def at(now: datetime, hours_back: int, minute: int) -> datetime:
    return hour_of(now) - timedelta(hours=hours_back) + timedelta(minutes=minute)


def cost_meter(stub: StripeStub) -> dict[str, int]:
    return {customer: value for (customer, meter), value in stub.totals().items() if meter == METER["cost"]}


def settled_micros(factory: sessionmaker[Session], tenant: str, now: datetime) -> int:
    with factory() as s:
        query = select(UsageEvent.cost).where(
            UsageEvent.tenant_id == tenant, UsageEvent.started_at < closed_before(now)
        )
        return sum(to_micros(Decimal(str(c))) for c in s.scalars(query) if c is not None)


def test_each_rollups_settled_cost_reaches_the_cost_meter_once(
    sessions: sessionmaker[Session], stub: StripeStub, now: datetime
) -> None:
    base = hour_of(now)
    records = [priced(usage("ten_post", at(now, h, m), 1000 * h, 200, 300, 41.7), TIER)
               for h in (2, 3) for m in (5, 40)]  # fmt: skip
    records += [priced(usage("ten_acme", base - timedelta(hours=2, minutes=-9), 5000, 0, 7000, 0.0), ACME)]
    unpriced = usage("ten_post", base - timedelta(hours=2, minutes=-50), 777, 0, 10, 3.0)  # database was down
    records += [unpriced, priced(usage("ten_post", base, 999, 0, 999, 9.0), TIER)]  # and the open hour
    add_usage(sessions, records, now)

    summary = run(sessions, stub, now)

    history = cost_of(Metered(777, 0, 10, 3.0), TIER)  # the unpriced row, billed from the price history
    assert cost_meter(stub) == {
        "cus_post": settled_micros(sessions, "ten_post", now) + to_micros(history),
        "cus_acme": to_micros(cost_of(Metered(5000, 0, 7000), ACME)),  # its own price, not the tier's
    }
    assert cost_meter(stub)["cus_acme"] == 5000 * 3 + 7000 * 9  # micro-units: 0.078 USD
    with sessions() as s:
        rollups = {
            r.id: r for r in s.scalars(select(UsageRollup).where(UsageRollup.hour < closed_before(now)))
        }
    cost_events = [e for e in stub.events if e.event_name == METER["cost"]]
    assert len(cost_events) == len(rollups) == 3  # one per closed rollup
    for event in cost_events:
        assert event.value == rollups[event.identifier.split("-")[0]].cost_micros
        assert event.identifier.endswith("-cost-r1")
    assert summary.prepaid == 0 and summary.failed == 0

    again = run(sessions, stub, now)
    assert (again.created, again.sent) == (0, 0)  # exactly once

    late = priced(usage("ten_post", base - timedelta(hours=3, minutes=-59), 100, 0, 100, 1.0), TIER)
    before, sent_before = cost_meter(stub)["cus_post"], len(stub.events)
    add_usage(sessions, [late], now)
    run(sessions, stub, now)
    increase = [e for e in stub.events[sent_before:] if e.event_name == METER["cost"]]
    assert [(e.value, e.identifier[-8:]) for e in increase] == [
        (to_micros(Decimal(str(late.cost))), "-cost-r2")
    ]
    assert cost_meter(stub)["cus_post"] == before + increase[0].value
    no_duplicates(stub)
    cfg = config(stub)
    start, end = base - timedelta(hours=6), base + timedelta(hours=1)
    with sessions() as s:
        assert reconcile(s, start=start, end=end, config=cfg, client=make_client(cfg), now=now) == []


def test_prepaid_usage_is_never_invoiced_and_the_log_accounts_for_it(
    sessions: sessionmaker[Session], stub: StripeStub, now: datetime
) -> None:
    base = hour_of(now)
    with session_scope(sessions) as s:
        entry = credit.add_credit(s, tenant_id="ten_pre", amount="10", kind="topup", reason="t", actor="ops")
        entry.created_at = base - timedelta(hours=3, minutes=-20)  # topped up 20 minutes into hour -3
        tenant = s.get(Tenant, "ten_pre")
        assert tenant is not None and tenant.prepaid_since is not None
        tenant.prepaid_since = entry.created_at  # the top-up made it prepaid
    hours = (4, 3, 2)  # -4: postpaid, invoiced; -3 (the top-up's hour) and -2: prepaid
    records = [priced(usage("ten_pre", at(now, h, 10), 100, 10, 50, 5.0), TIER) for h in hours]
    add_usage(sessions, records, now)

    summary = run(sessions, stub, now)

    before_credit = base - timedelta(hours=4) + timedelta(minutes=30)
    assert {e.timestamp for e in stub.events} == {int(before_credit.timestamp())}
    assert len(stub.events) == 5 and summary.sent == 5  # four quantities and the cost, of hour -4 only
    prepaid_rows = [r for r in exports(sessions) if r.status == "skipped"]
    assert summary.prepaid == len(prepaid_rows) == 2 * 5 and summary.skipped == 0
    assert all(r.last_error == PREPAID and r.attempts == 0 for r in prepaid_rows)
    with sessions() as s:
        first = s.scalar(select(CreditEntry.created_at).where(CreditEntry.tenant_id == "ten_pre"))
    assert first is not None and all(r.timestamp >= hour_of(first) for r in prepaid_rows)

    late = priced(usage("ten_pre", base - timedelta(hours=2, minutes=-55), 10, 0, 10, 1.0), TIER)
    add_usage(sessions, [late], now)
    again = run(sessions, stub, now)
    assert (again.sent, again.prepaid) == (0, 4)  # its increase is accounted, not sent (no cached tokens)
    assert len(stub.events) == 5

    cfg = config(stub)
    with sessions() as s:  # the rollups equal sent + skipped, and Stripe holds what was sent
        found = reconcile(s, start=base - timedelta(hours=6), end=base, config=cfg, client=make_client(cfg),
                          now=now)  # fmt: skip
    assert found == []


def test_a_rollup_whose_cost_was_never_computed_sends_no_cost(
    sessions: sessionmaker[Session], stub: StripeStub, now: datetime
) -> None:
    """Rollups from before the cost column (0008) hold NULL until their hour is recomputed: their
    quantities go out as before, no cost is made up for them."""
    add_usage(sessions, [priced(usage("ten_post", at(now, 2, 0), 100, 0, 100, 2.0), TIER)], now)
    with session_scope(sessions) as s:
        s.execute(update(UsageRollup).values(cost_micros=None))

    run(sessions, stub, now)

    assert cost_meter(stub) == {}
    assert {e.event_name for e in stub.events} == {
        METER[k] for k in METER if k not in ("cost", "cached_input_tokens")
    }
