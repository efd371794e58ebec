"""The credit ledger and spend limits in the database (issue 29), on both backends: the balance is the
ledger minus settled costs, amounts are exact, and prepaid credit pins the tenant's currency."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from app.budgets.guard import periods_at
from app.budgets.local_backend import LocalBudgets
from billing import credit, repository
from billing.errors import InvalidLimits, InvalidPrice
from billing.micros import to_micros
from billing.models import Tenant, UsageEvent, utcnow


def test_balance_is_the_ledger_minus_settled_costs(session_factory: sessionmaker[Session]) -> None:
    now = utcnow()  # usage after the top-up: paid from credit
    with session_factory() as s, s.begin():
        tenant = repository.create_tenant(s, name="acme")
        credit.add_credit(s, tenant_id=tenant.id, amount="10.5", kind="topup", reason="paid", actor="ops")
        credit.add_credit(
            s, tenant_id=tenant.id, amount="-0.25", kind="adjustment", reason="fix", actor="ops"
        )
        s.add(UsageEvent(request_id="r1", tenant_id=tenant.id, key_id="k", model="m", base_model="m",
                         status="completed", prompt_tokens=1, cached_tokens=0, completion_tokens=1,
                         gpu_ms=0.0, queue_ms=0.0, latency_ms=1.0, started_at=now, finished_at=now,
                         cost=Decimal("0.000003"), currency="usd"))  # fmt: skip
        credit.set_spend_limit(s, tenant_id=tenant.id, period="day", amount="2", hard=False)
    with session_factory() as s:
        snap = credit.snapshot(s, tenant_id=tenant.id, now=now)
    assert snap.balance == 10_249_997 and snap.version == 2
    assert (snap.spent_day, snap.spent_month, snap.day_key) == (3, 3, credit.period_key("day", now))
    assert snap.limits == {"day": (2_000_000, False)} and snap.governed


@pytest.mark.parametrize("amount", ["0", "-1", "0.0000001", 1.5, "nan"])
def test_a_top_up_must_be_a_positive_exact_amount(
    session_factory: sessionmaker[Session], amount: object
) -> None:
    with session_factory() as s, s.begin():
        tenant = repository.create_tenant(s, name="acme")
        with pytest.raises(credit.InvalidAmount):
            credit.add_credit(s, tenant_id=tenant.id, amount=amount, kind="topup", reason="", actor="ops")  # type: ignore[arg-type]


def test_prepaid_credit_pins_the_currency(session_factory: sessionmaker[Session]) -> None:
    with session_factory() as s, s.begin():
        repository.create_tier(s, name="euro", currency="eur")
        tenant = repository.create_tenant(s, name="acme")
        credit.add_credit(s, tenant_id=tenant.id, amount="1", kind="topup", reason="", actor="ops")
        with pytest.raises(InvalidLimits):
            repository.update_tenant(s, tenant_id=tenant.id, tier="euro")
        with pytest.raises(InvalidPrice):
            repository.update_tier(s, name="free", currency="eur")
        repository.update_tier(s, name="free", price_output_per_mtok="1")  # prices may change; a new row


def usage_row(tenant_id: str, started_at: datetime, cost: str) -> UsageEvent:
    return UsageEvent(request_id=f"r-{started_at.isoformat()}", tenant_id=tenant_id, key_id="k", model="m",
                      base_model="m", status="completed", prompt_tokens=1, cached_tokens=0,
                      completion_tokens=1, gpu_ms=0.0, queue_ms=0.0, latency_ms=1.0, started_at=started_at,
                      finished_at=started_at, cost=Decimal(cost), currency="usd")  # fmt: skip


def test_credit_pays_for_usage_from_the_hour_the_tenant_became_prepaid(
    session_factory: sessionmaker[Session],
) -> None:
    """Issue 35, item 3: the hours before are invoiced (the Stripe export counts prepaid usage from the same
    hour), so they are not charged to credit too; the top-up's own hour is, all of it."""
    since = datetime(2026, 11, 20, 10, 20, tzinfo=UTC)
    with session_factory() as s, s.begin():
        tenant = repository.create_tenant(s, name="acme")
        credit.add_credit(s, tenant_id=tenant.id, amount="100", kind="topup", reason="", actor="ops")
        row = s.get(Tenant, tenant.id)
        assert row is not None and row.prepaid_since is not None
        row.prepaid_since = since
        s.add_all([usage_row(tenant.id, since - timedelta(days=20), "80"),  # invoiced
                   usage_row(tenant.id, since - timedelta(minutes=21), "7"),  # 09:59: invoiced
                   usage_row(tenant.id, since - timedelta(minutes=15), "0.5"),  # 10:05: credit's
                   usage_row(tenant.id, since + timedelta(hours=1), "1.25")])  # fmt: skip
    with session_factory() as s:
        assert credit.snapshot(s, tenant_id=tenant.id).balance == 98_250_000
    assert credit.prepaid_from(since) == datetime(2026, 11, 20, 10, tzinfo=UTC)


def test_only_credit_granted_makes_a_tenant_prepaid(session_factory: sessionmaker[Session]) -> None:
    with session_factory() as s, s.begin():
        tenant = repository.create_tenant(s, name="acme")
        with pytest.raises(credit.NotPrepaid) as refused:
            credit.add_credit(s, tenant_id=tenant.id, amount="-1", kind="adjustment", reason="", actor="ops")
        assert refused.value.field == "amount" and refused.value.code == "tenant_not_prepaid"
        assert (tenant.prepaid, tenant.prepaid_since, credit.credit_entries(s, tenant_id=tenant.id)) == (
            False, None, [],
        )  # fmt: skip
        entry = credit.add_credit(
            s, tenant_id=tenant.id, amount="2", kind="adjustment", reason="", actor="ops"
        )
        credit.add_credit(s, tenant_id=tenant.id, amount="-1", kind="adjustment", reason="", actor="ops")
        credit.add_credit(s, tenant_id=tenant.id, amount="5", kind="topup", reason="", actor="ops")
        assert tenant.prepaid and tenant.prepaid_since == entry.created_at  # the first grant, kept


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
async def test_a_snapshot_counts_the_entries_its_balance_holds(
    session_factory: sessionmaker[Session],
) -> None:
    """Issue 35, item 4: an entry committed while a snapshot is read is either in both its balance and its
    version or in neither (PostgreSQL reads each statement as committed when it runs), so its notice is
    then counted exactly once."""
    sessions = session_factory
    engine = sessions.kw["bind"]
    with sessions() as s, s.begin():
        tenant_id = repository.create_tenant(s, name="acme").id
        credit.add_credit(s, tenant_id=tenant_id, amount="5", kind="topup", reason="", actor="ops")
    written: list[tuple[int, int]] = []

    def top_up_meanwhile(conn: object, cursor: object, statement: str, *_: object) -> None:
        if written or "credit_entries" not in statement or not statement.lstrip().startswith("SELECT"):
            return
        written.append((0, 0))
        with sessions() as other, other.begin():  # another replica's top-up commits between the reads
            entry = credit.add_credit(other, tenant_id=tenant_id, amount="7", kind="topup", reason="",
                                      actor="ops")  # fmt: skip
            written[0] = (to_micros(entry.amount), credit.credit_version(other, tenant_id=tenant_id))

    event.listen(engine, "after_cursor_execute", top_up_meanwhile)
    try:
        with sessions() as s:
            snap = credit.snapshot(s, tenant_id=tenant_id)
    finally:
        event.remove(engine, "after_cursor_execute", top_up_meanwhile)
    budgets = LocalBudgets()
    await budgets.load(snap, snap.version)
    await budgets.credit(tenant_id, *written[0])
    with sessions() as s:
        truth = credit.snapshot(s, tenant_id=tenant_id)
    assert written[0] == (7_000_000, 2) and truth.balance == 12_000_000
    live = await budgets.peek(tenant_id, periods_at())
    assert live is not None and live.balance == truth.balance
