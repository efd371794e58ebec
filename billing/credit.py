"""Credit and spend limits in the database, which is the truth the limiter's budgets are loaded from.

A tenant's balance is the sum of its credit ledger (top-ups and adjustments) minus the settled cost of its
usage rows from the UTC hour it became prepaid (the hours before were invoiced: billing.stripe_export counts
prepaid usage from the same hour); its spend in a period is the sum of those costs over the UTC day or
month. A BudgetSnapshot is all of that at one moment, in micro-units, as the limiter backends hold it
(app/budgets).
"""

from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Literal

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from billing import repository
from billing.errors import InvalidLimits, TenantNotFound
from billing.micros import MAX_MICROS, from_micros, to_micros
from billing.models import PERIODS, BudgetEvent, CreditEntry, SpendLimit, Tenant, UsageEvent, new_id, utcnow

Period = Literal["day", "month"]
Kind = Literal["topup", "adjustment"]
Surface = Literal["admin_api", "cli"]  # billing.models.SURFACES (app.surfaces tells them apart)


class InvalidAmount(InvalidLimits):
    """An amount of money that is not a finite decimal with at most 6 decimals in range."""

    code = "invalid_amount"


class CreditOutOfRange(InvalidAmount):
    """An entry that would take the tenant's credit past what a balance can hold (billing.micros.MAX_MICROS):
    its snapshot could not be read, so every request it made would fail."""

    code = "credit_out_of_range"


class NotPrepaid(InvalidAmount):
    """A negative adjustment of a postpaid tenant: it holds no credit to correct (its usage is invoiced)."""

    code = "tenant_not_prepaid"


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
    # Credit entries counted (entries are numbered 1, 2, ... in the order written): an entry with a higher
    # number is not in `balance` yet. 0 for a tenant read as postpaid: its first credit's notice makes the
    # backend load it again, even when that entry was committed while this snapshot was read.
    version: int = 0

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
    s: Session,
    *,
    tenant_id: str,
    amount: Decimal | int | str,
    kind: Kind,
    reason: str,
    actor: str,
    request_id: str | None = None,
    surface: Surface | None = None,
) -> CreditEntry:
    """Append a top-up (amount > 0) or an adjustment (either sign) in the tenant's tier's currency. The
    first credit granted (a top-up or a positive adjustment) makes a postpaid tenant prepaid from now on.
    `actor` is what the caller says; `request_id` and `surface` are what the server saw (None: written
    directly, not through a surface). Raises TenantNotFound, InvalidAmount (NotPrepaid: a negative
    adjustment of a postpaid tenant)."""
    tenant = _locked_tenant(s, tenant_id)
    checked = check_amount("amount", amount, positive=kind == "topup")
    _check_within_range(credited(s, tenant_id=tenant_id), checked)
    if not tenant.prepaid and checked < 0:
        raise NotPrepaid(
            "amount", str(checked), "above 0 for a postpaid tenant (it holds no credit to correct)"
        )
    currency = repository.get_tier(s, name=tenant.tier).currency
    entry = CreditEntry(tenant_id=tenant_id, amount=checked, currency=currency, kind=kind, reason=reason,
                        actor=actor, created_at=utcnow(), request_id=request_id, surface=surface)  # fmt: skip
    s.add(entry)
    if not tenant.prepaid:
        tenant.prepaid, tenant.prepaid_since = True, entry.created_at
    s.flush()
    return entry


def _locked_tenant(s: Session, tenant_id: str) -> Tenant:
    """The tenant, its row locked until the transaction ends (PostgreSQL; SQLite writes one at a time), so
    that concurrent entries are checked against each other's sums and numbered one after another
    (credit_version). Raises TenantNotFound."""
    tenant = s.get(Tenant, tenant_id, with_for_update=True)
    if tenant is None:
        raise TenantNotFound(tenant_id)
    return tenant


def _check_within_range(credited_micros: int, amount: Decimal) -> None:
    """Raises CreditOutOfRange when the ledger's sum with `amount` would pass MAX_MICROS either way."""
    total = credited_micros + to_micros(amount)
    if abs(total) > MAX_MICROS:
        most, now = from_micros(MAX_MICROS), from_micros(credited_micros)
        requirement = f"within the most credit a tenant may hold, {most} either way (it holds {now})"
        raise CreditOutOfRange("amount", str(amount), requirement)


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
    return ledger(s, tenant_id=tenant_id)[0]


def ledger(s: Session, *, tenant_id: str) -> tuple[int, int]:
    """The tenant's credit in micro-units and how many entries make it, read in one statement: two would
    each see what was committed when they ran (PostgreSQL's read committed), so an entry committed between
    them would be counted in one and not the other, and then either skipped or counted twice."""
    total, count = s.execute(
        select(func.sum(CreditEntry.amount), func.count()).where(CreditEntry.tenant_id == tenant_id)
    ).one()
    micros = 0 if total is None else to_micros(Decimal(str(total)).quantize(Decimal("0.000001")))
    return micros, int(count or 0)


def snapshot(s: Session, *, tenant_id: str, now: datetime | None = None) -> BudgetSnapshot:
    """The tenant's budget as the limiter loads it. Raises TenantNotFound."""
    now = now or utcnow()
    tenant = repository.get_tenant(s, tenant_id=tenant_id)
    currency = repository.get_tier(s, name=tenant.tier).currency
    balance, version = None, 0
    if tenant.prepaid:
        since = prepaid_from(tenant.prepaid_since)
        credited_micros, version = ledger(s, tenant_id=tenant_id)
        balance = credited_micros - settled_cost(s, tenant_id=tenant_id, start=since)
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
        version=version,
    )


def prepaid_from(prepaid_since: datetime | None) -> datetime | None:
    """The first UTC hour whose usage credit pays: the hour the tenant became prepaid. Whole hours, as the
    Stripe export's rollups are: that hour is not invoiced, so its usage before the top-up is paid from
    credit rather than not at all. None (prepaid before the time was recorded): all of its usage."""
    if prepaid_since is None:
        return None
    return prepaid_since.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def credit_version(s: Session, *, tenant_id: str) -> int:
    """How many credit entries the tenant has. Read in the transaction that wrote an entry (add_credit,
    which holds the tenant's row locked until it ends), it is that entry's version: writers take turns, so
    two concurrent entries are n+1 and n+2, never both n+1, and each version names one entry."""
    return ledger(s, tenant_id=tenant_id)[1]


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
