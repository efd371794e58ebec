"""Usage recording (idempotent on request_id) and hourly rollups per tenant, adapter and base model.

Rollups are recomputed from the events for whole hours, so a late event (an outbox that was down) lands in
its own hour's rollup; the Stripe exporter then sends only the increase (see stripe_export.py). Each
currency of an hour is a rollup of its own: money in two currencies is never summed.
hour_expression and as_hour define those UTC hours in SQL; billing.usage_queries groups by them too.
"""

import hashlib
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import ColumnElement, case, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from billing.micros import MICROS, to_micros
from billing.models import BASE_ADAPTER_KEY, STORAGE_MODEL, UsageEvent, UsageRollup, utcnow
from billing.price_book import PriceHistory


@dataclass(frozen=True)
class UsageRecord:
    """One request's usage on its way from an ingress replica to the billing database (picklable)."""

    request_id: str
    tenant_id: str
    key_id: str
    model: str
    base_model: str
    adapter_id: str | None
    adapter_version: int | None
    status: str  # completed | aborted | failed
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    gpu_ms: float
    queue_ms: float
    ttft_ms: float | None
    latency_ms: float
    replica: str | None
    started_at: datetime
    finished_at: datetime
    cost: str | None = None  # a decimal string (exact through JSON), fixed at settlement; None: unpriced
    currency: str | None = None
    batch_id: str | None = None  # a Batch API line's batch; None: an interactive request


def record_usage(session: Session, records: list[UsageRecord]) -> int:
    """Insert what is new; a request id already recorded is ignored. Returns how many rows were new."""
    return len(record_new_usage(session, records))


def record_new_usage(session: Session, records: list[UsageRecord]) -> set[str]:
    """Insert what is new, as record_usage does; returns the request ids this call inserted (a racing
    writer of the same id waits for this transaction on PostgreSQL, then finds it)."""
    if not records:
        return set()
    rows = [
        {**asdict(r), "cost": None if r.cost is None else Decimal(r.cost), "recorded_at": utcnow()}
        for r in records
    ]
    dialect = session.get_bind().dialect.name
    if dialect not in ("postgresql", "sqlite"):
        raise NotImplementedError(f"usage recording needs PostgreSQL or SQLite, not {dialect}")
    insert_ = postgresql.insert if dialect == "postgresql" else sqlite.insert
    # RETURNING lists only the rows this statement inserted: the duplicates it skipped are not counted.
    statement = insert_(UsageEvent).on_conflict_do_nothing(index_elements=["request_id"])
    # executemany: SQLAlchemy batches it into multi-row INSERTs itself ("insertmanyvalues"), far cheaper
    # than compiling one statement with every value inlined.
    return set(session.scalars(statement.returning(UsageEvent.request_id), rows).all())


def hour_of(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def rollup_id(tenant_id: str, adapter_key: str, base_model: str, hour: datetime, currency: str) -> str:
    """Deterministic, so two runs making the same rollup collide instead of doubling it. Given once, when
    the row is made: recomputing finds the row by its key (rows from before 0011 keep ids made without
    the currency)."""
    key = f"{tenant_id}|{adapter_key}|{base_model}|{hour_of(hour).isoformat()}|{currency}"
    return "ru_" + hashlib.sha256(key.encode()).hexdigest()[:24]


def closed_before(now: datetime, *, grace: timedelta = timedelta(minutes=10)) -> datetime:
    """Hours starting before this are closed: over, plus a grace period for events still in flight."""
    return hour_of(now - grace)


# A rollup's key: tenant, adapter key, base model, hour, currency.
RollupKey = tuple[str, str, str, datetime, str]
NO_CURRENCY = "xxx"  # ISO 4217's code for "no currency": rows no price covers


@dataclass
class _Sums:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    gpu_ms: float = 0.0
    cost_micros: int = 0

    def add(self, other: "_Sums") -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)


def rollup_hours(session: Session, *, start: datetime, end: datetime) -> int:
    """Recompute the rollups of every hour in [hour_of(start), hour_of(end)) from the events, one per
    tenant, adapter, base model and currency. Returns how many rollups the hours have."""
    first, last = hour_of(start), hour_of(end)
    if last <= first:
        return 0
    sums = _settled_sums(session, first, last)
    for key, unpriced in _unpriced_sums(session, first, last).items():
        sums.setdefault(key, _Sums()).add(unpriced)
    existing = {
        rollup_key(r): r
        for r in session.scalars(
            select(UsageRollup).where(UsageRollup.hour >= first, UsageRollup.hour < last)
        )
    }
    for key, totals in sums.items():
        _write(session, key, asdict(totals), existing.get(key))
    for key, rollup in existing.items():
        if key not in sums:  # its events vanished (only by hand): keep the row, exports point at it
            _write(session, key, asdict(_Sums()), rollup)
    session.flush()
    return len(sums)


def _write(session: Session, key: RollupKey, values: dict[str, Any], rollup: UsageRollup | None) -> None:
    """A new rollup for the key, or the existing one changed where it differs (its id is kept)."""
    if rollup is None:
        tenant_id, adapter_key, base_model, hour, currency = key
        rollup = UsageRollup(id=rollup_id(*key), tenant_id=tenant_id, adapter_key=adapter_key,
                             base_model=base_model, hour=hour, currency=currency)  # fmt: skip
        session.add(rollup)
    for name, value in values.items():
        if getattr(rollup, name) != value:
            setattr(rollup, name, value)


def rollup_key(rollup: UsageRollup) -> RollupKey:
    return (rollup.tenant_id, rollup.adapter_key, rollup.base_model, as_hour(rollup.hour), rollup.currency)


def _settled_sums(session: Session, first: datetime, last: datetime) -> dict[RollupKey, _Sums]:
    """The rows settled with a cost, summed in SQL per rollup key (their currency is theirs)."""
    hour_expr = hour_expression(session)
    adapter_key = func.coalesce(UsageEvent.adapter_id, BASE_ADAPTER_KEY)
    keys = (UsageEvent.tenant_id, adapter_key, UsageEvent.base_model, hour_expr, UsageEvent.currency)
    query = (
        select(
            *keys,
            requests_count(),
            func.sum(UsageEvent.prompt_tokens),
            func.sum(UsageEvent.cached_tokens),
            func.sum(UsageEvent.completion_tokens),
            func.sum(UsageEvent.gpu_ms),
            func.sum(func.round(UsageEvent.cost * MICROS)),  # exact: 6 decimals each
        )
        .where(UsageEvent.started_at >= first, UsageEvent.started_at < last, UsageEvent.cost.is_not(None))
        .group_by(*keys)
    )
    sums: dict[RollupKey, _Sums] = {}
    for tenant_id, adapter, base_model, hour, currency, *totals in session.execute(query).tuples():
        requests, prompt, cached, completion, gpu_ms, cost = totals
        key = (tenant_id, adapter, base_model, as_hour(hour), currency or NO_CURRENCY)
        sums.setdefault(key, _Sums()).add(
            _Sums(int(requests), int(prompt or 0), int(cached or 0), int(completion or 0),
                  float(gpu_ms or 0.0), int(cost or 0))
        )  # fmt: skip
    return sums


def _unpriced_sums(session: Session, first: datetime, last: datetime) -> dict[RollupKey, _Sums]:
    """The rows settled without a cost (rare: the database was down at admission), each at the price
    history's prices and in its currency, as billing reconcile bills them."""
    events = session.scalars(
        select(UsageEvent).where(
            UsageEvent.started_at >= first, UsageEvent.started_at < last, UsageEvent.cost.is_(None)
        )
    ).all()
    if not events:
        return {}
    history = PriceHistory(session)
    sums: dict[RollupKey, _Sums] = {}
    for event in events:
        cost, currency = history.priced(event) or (Decimal(0), NO_CURRENCY)
        key = (event.tenant_id, event.adapter_id or BASE_ADAPTER_KEY, event.base_model,
               hour_of(event.started_at), currency)  # fmt: skip
        sums.setdefault(key, _Sums()).add(
            _Sums(1, event.prompt_tokens, event.cached_tokens, event.completion_tokens, event.gpu_ms,
                  to_micros(cost))
        )  # fmt: skip
    return sums


def requests_count() -> ColumnElement[int]:
    """How many of the grouped usage rows are requests: an hour's storage charge is a row, not a request."""
    return func.count(case((UsageEvent.base_model != STORAGE_MODEL, 1)))


def hour_expression(session: Session) -> ColumnElement[Any]:
    """started_at truncated to its UTC hour, in SQL: the rollups' hours, and billing.usage_queries' too.

    Read the selected value back with as_hour."""
    if session.get_bind().dialect.name == "postgresql":
        return func.date_trunc("hour", func.timezone("UTC", UsageEvent.started_at))
    return func.strftime("%Y-%m-%d %H:00:00", UsageEvent.started_at)  # SQLite stores UTC text


def as_hour(value: object) -> datetime:
    """A value selected with hour_expression as an aware UTC datetime (SQLite returns it as text)."""
    if isinstance(value, str):
        return datetime.strptime(value, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
    if not isinstance(value, datetime):
        raise TypeError(f"unexpected hour value {value!r}")
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
