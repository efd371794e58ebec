"""The credit ledger and spend limits in the database (issue 29), on both backends: the balance is the
ledger minus settled costs, amounts are exact, and prepaid credit pins the tenant's currency."""

from datetime import UTC, datetime
from decimal import Decimal

import pytest
from sqlalchemy.orm import Session, sessionmaker

from billing import credit, repository
from billing.errors import InvalidLimits, InvalidPrice
from billing.models import UsageEvent


def test_balance_is_the_ledger_minus_settled_costs(session_factory: sessionmaker[Session]) -> None:
    now = datetime(2026, 11, 27, 12, tzinfo=UTC)
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
    assert (snap.spent_day, snap.spent_month, snap.day_key) == (3, 3, "day:2026-11-27")
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
