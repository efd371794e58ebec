"""Credit and spend limits in the database, which is the truth the limiter's budgets are loaded from.

A tenant's balance is the sum of its credit ledger (top-ups and adjustments) minus the settled cost of its
usage rows; its spend in a period is the sum of those costs over the UTC day or month. A BudgetSnapshot is
all of that at one moment, in micro-units, as the limiter backends hold it (app/budgets).
"""

from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Literal

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from billing import repository
from billing.errors import InvalidLimits
from billing.micros import MAX_MICROS, from_micros, to_micros
from billing.models import PERIODS, BudgetEvent, CreditEntry, SpendLimit, UsageEvent, new_id, utcnow

Period = Literal["day", "month"]
Kind = Literal["topup", "adjustment"]


class InvalidAmount(InvalidLimits):
    """An amount of money that is not a finite decimal with at most 6 decimals in range."""


@dataclass(frozen=True)
class BudgetSnapshot:
    """A tenant's money at one moment, in micro-units of `currency`. `balance` is None for a tenant that
    is not prepaid (no credit to run out of); `limits` maps a period to (amount, hard)."""

    tenant_id: str
    currency: str
    balance: int | None
    day_key: str
    month_key: str
    spent_day: int
    spent_month: int
    limits: dict[str, tuple[int, bool]]
    version: int = 0  # credit entries counted: a top-up with a higher number is not in `balance` yet

    @property
    def governed(self) -> bool:
        """Whether admission has anything to check for this tenant."""
        return self.balance is not None or bool(self.limits)


def period_key(period: str, at: datetime) -> str:
    at = at.astimezone(UTC)
    return f"day:{at:%Y-%m-%d}" if period == "day" else f"month:{at:%Y-%m}"


def period_start(period: str, at: datetime) -> datetime:
    at = at.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return at if period == "day" else at.replace(day=1)


def check_amount(field: str, value: object, *, positive: bool = False) -> Decimal:
    """Money as stored: a Decimal (or int, or decimal string) with at most 6 decimals, never a float."""
    requirement = "a decimal with at most 6 decimals" + (", above 0" if positive else ", not 0")
    if isinstance(value, bool) or not isinstance(value, Decimal | int | str):
        raise InvalidAmount(field, value, requirement)
    try:
        amount = Decimal(value)
        micros = to_micros(amount)
    except (InvalidOperation, ValueError):
        raise InvalidAmount(field, value, requirement) from None
    if micros == 0 or (positive and micros < 0) or abs(micros) > MAX_MICROS // 10:
        raise InvalidAmount(field, value, requirement)
    return from_micros(micros)


def add_credit(
    s: Session, *, tenant_id: str, amount: Decimal | int | str, kind: Kind, reason: str, actor: str
) -> CreditEntry:
    """Append a top-up (amount > 0) or an adjustment (either sign) in the tenant's tier's currency, and
    make the tenant prepaid. Raises TenantNotFound, InvalidAmount."""
    tenant = repository.get_tenant(s, tenant_id=tenant_id)
    checked = check_amount("amount", amount, positive=kind == "topup")
    currency = repository.get_tier(s, name=tenant.tier).currency
    entry = CreditEntry(
        tenant_id=tenant_id, amount=checked, currency=currency, kind=kind, reason=reason, actor=actor
    )
    s.add(entry)
    tenant.prepaid = True
    s.flush()
    return entry


def credit_entries(s: Session, *, tenant_id: str) -> list[CreditEntry]:
    repository.get_tenant(s, tenant_id=tenant_id)
    query = select(CreditEntry).where(CreditEntry.tenant_id == tenant_id)
    return list(s.scalars(query.order_by(CreditEntry.created_at, CreditEntry.id)))


def set_spend_limit(
    s: Session, *, tenant_id: str, period: Period, amount: Decimal | int | str | None, hard: bool = True
) -> SpendLimit | None:
    """Set (or, with None, remove) the tenant's limit for a period. Raises TenantNotFound, InvalidAmount."""
    repository.get_tenant(s, tenant_id=tenant_id)
    if period not in PERIODS:
        raise InvalidLimits("period", period, "'day' or 'month'")
    row = s.get(SpendLimit, (tenant_id, period))
    if amount is None:
        if row is not None:
            s.delete(row)
            s.flush()
        return None
    checked = check_amount(f"{period}_limit", amount, positive=True)
    if row is None:
        row = SpendLimit(tenant_id=tenant_id, period=period, amount=checked, hard=hard)
        s.add(row)
    else:
        row.amount, row.hard = checked, hard
    s.flush()
    return row


def spend_limits(s: Session, *, tenant_id: str) -> list[SpendLimit]:
    return list(s.scalars(select(SpendLimit).where(SpendLimit.tenant_id == tenant_id)))


def has_spend_limits(s: Session, *, tenant_id: str) -> bool:
    return s.scalar(select(SpendLimit.period).where(SpendLimit.tenant_id == tenant_id).limit(1)) is not None


def settled_cost(
    s: Session, *, tenant_id: str, start: datetime | None = None, end: datetime | None = None
) -> int:
    """The settled cost of the tenant's usage rows that started in [start, end), in micro-units."""
    query = select(func.sum(UsageEvent.cost)).where(UsageEvent.tenant_id == tenant_id)
    if start is not None:
        query = query.where(UsageEvent.started_at >= start)
    if end is not None:
        query = query.where(UsageEvent.started_at < end)
    total = s.scalar(query)
    return 0 if total is None else to_micros(Decimal(str(total)).quantize(Decimal("0.000001")))


def credited(s: Session, *, tenant_id: str) -> int:
    total = s.scalar(select(func.sum(CreditEntry.amount)).where(CreditEntry.tenant_id == tenant_id))
    return 0 if total is None else to_micros(Decimal(str(total)).quantize(Decimal("0.000001")))


def snapshot(s: Session, *, tenant_id: str, now: datetime | None = None) -> BudgetSnapshot:
    """The tenant's budget as the limiter loads it. Raises TenantNotFound."""
    now = now or utcnow()
    tenant = repository.get_tenant(s, tenant_id=tenant_id)
    currency = repository.get_tier(s, name=tenant.tier).currency
    balance = None
    if tenant.prepaid:
        balance = credited(s, tenant_id=tenant_id) - settled_cost(s, tenant_id=tenant_id)
    limits = {
        row.period: (to_micros(Decimal(row.amount)), row.hard) for row in spend_limits(s, tenant_id=tenant_id)
    }
    return BudgetSnapshot(
        tenant_id=tenant_id,
        currency=currency,
        balance=balance,
        day_key=period_key("day", now),
        month_key=period_key("month", now),
        spent_day=settled_cost(s, tenant_id=tenant_id, start=period_start("day", now)),
        spent_month=settled_cost(s, tenant_id=tenant_id, start=period_start("month", now)),
        limits=limits,
        version=credit_version(s, tenant_id=tenant_id),
    )


def credit_version(s: Session, *, tenant_id: str) -> int:
    """How many credit entries the tenant has: the version a backend's balance has counted up to."""
    return int(s.scalar(select(func.count()).where(CreditEntry.tenant_id == tenant_id)) or 0)


def record_event(s: Session, *, tenant_id: str, period_key: str, kind: str, detail: str) -> bool:
    """Write the event unless this period already has one of its kind; True when it was new."""
    dialect = s.get_bind().dialect.name
    insert_ = postgresql.insert if dialect == "postgresql" else sqlite.insert
    statement = insert_(BudgetEvent).on_conflict_do_nothing(
        index_elements=["tenant_id", "period_key", "kind"]
    )
    row = {"id": new_id("bev"), "tenant_id": tenant_id, "period_key": period_key, "kind": kind,
           "detail": detail, "created_at": utcnow()}  # fmt: skip
    return len(s.execute(statement.returning(BudgetEvent.id), [row]).all()) == 1


def events(s: Session, *, tenant_id: str, period_keys: list[str]) -> list[BudgetEvent]:
    query = select(BudgetEvent).where(
        BudgetEvent.tenant_id == tenant_id, BudgetEvent.period_key.in_(period_keys)
    )
    return list(s.scalars(query.order_by(BudgetEvent.created_at)))


def as_amount(micros: int | None) -> Decimal | None:
    return None if micros is None else from_micros(micros)
