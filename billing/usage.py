"""Usage recording (idempotent on request_id) and hourly rollups per tenant, adapter and base model.

Rollups are recomputed from the events for whole hours, so a late event (an outbox that was down) lands in
its own hour's rollup; the Stripe exporter then sends only the increase (see stripe_export.py).
hour_expression and as_hour define those UTC hours in SQL; billing.usage_queries groups by them too.
"""

import hashlib
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from billing.micros import MICROS, to_micros
from billing.models import BASE_ADAPTER_KEY, UsageEvent, UsageRollup, utcnow
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


def record_usage(session: Session, records: list[UsageRecord]) -> int:
    """Insert what is new; a request id already recorded is ignored. Returns how many rows were new."""
    if not records:
        return 0
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
    return len(session.execute(statement.returning(UsageEvent.request_id), rows).all())


def hour_of(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def rollup_id(tenant_id: str, adapter_key: str, base_model: str, hour: datetime) -> str:
    """Deterministic: recomputing an hour keeps its id (and so its Stripe identifiers)."""
    key = f"{tenant_id}|{adapter_key}|{base_model}|{hour_of(hour).isoformat()}"
    return "ru_" + hashlib.sha256(key.encode()).hexdigest()[:24]


def closed_before(now: datetime, *, grace: timedelta = timedelta(minutes=10)) -> datetime:
    """Hours starting before this are closed: over, plus a grace period for events still in flight."""
    return hour_of(now - grace)


def rollup_hours(session: Session, *, start: datetime, end: datetime) -> int:
    """Recompute the rollups of every hour in [hour_of(start), hour_of(end)) from the events. Returns rows."""
    first, last = hour_of(start), hour_of(end)
    if last <= first:
        return 0
    hour_expr = hour_expression(session)
    adapter_key = func.coalesce(UsageEvent.adapter_id, BASE_ADAPTER_KEY)
    query = (
        select(
            UsageEvent.tenant_id,
            adapter_key.label("adapter_key"),
            UsageEvent.base_model,
            hour_expr.label("hour"),
            func.count().label("requests"),
            func.sum(UsageEvent.prompt_tokens).label("prompt_tokens"),
            func.sum(UsageEvent.cached_tokens).label("cached_tokens"),
            func.sum(UsageEvent.completion_tokens).label("completion_tokens"),
            func.sum(UsageEvent.gpu_ms).label("gpu_ms"),
            func.sum(func.round(UsageEvent.cost * MICROS)).label("cost_micros"),  # exact: 6 decimals each
        )
        .where(UsageEvent.started_at >= first, UsageEvent.started_at < last)
        .group_by(UsageEvent.tenant_id, adapter_key, UsageEvent.base_model, hour_expr)
    )
    totals = session.execute(query).all()
    existing = {
        r.id: r
        for r in session.scalars(
            select(UsageRollup).where(UsageRollup.hour >= first, UsageRollup.hour < last)
        )
    }
    unpriced = _unpriced_micros(session, first, last)
    seen: set[str] = set()
    for row in totals:
        hour = as_hour(row.hour)
        rid = rollup_id(row.tenant_id, row.adapter_key, row.base_model, hour)
        seen.add(rid)
        values = {
            "requests": int(row.requests),
            "prompt_tokens": int(row.prompt_tokens or 0),
            "cached_tokens": int(row.cached_tokens or 0),
            "completion_tokens": int(row.completion_tokens or 0),
            "gpu_ms": float(row.gpu_ms or 0.0),
            "cost_micros": int(row.cost_micros or 0) + unpriced.get(rid, 0),
        }
        rollup = existing.get(rid)
        if rollup is None:
            session.add(UsageRollup(id=rid, tenant_id=row.tenant_id, adapter_key=row.adapter_key,
                                    base_model=row.base_model, hour=hour, **values))  # fmt: skip
        elif any(getattr(rollup, k) != v for k, v in values.items()):
            for name, value in values.items():
                setattr(rollup, name, value)
    for rid, rollup in existing.items():
        if rid not in seen:  # its events vanished (only by hand): keep the row, exports point at it
            rollup.requests = rollup.prompt_tokens = rollup.cached_tokens = rollup.completion_tokens = 0
            rollup.gpu_ms = 0.0
            rollup.cost_micros = 0
    session.flush()
    return len(totals)


def _unpriced_micros(session: Session, first: datetime, last: datetime) -> dict[str, int]:
    """Rollup id -> the cost of its rows settled without one (rare: the database was down at admission),
    at the price history's prices, as billing reconcile bills them."""
    events = session.scalars(
        select(UsageEvent).where(
            UsageEvent.started_at >= first, UsageEvent.started_at < last, UsageEvent.cost.is_(None)
        )
    ).all()
    if not events:
        return {}
    history = PriceHistory(session)
    micros: dict[str, int] = {}
    for event in events:
        rid = rollup_id(event.tenant_id, event.adapter_id or BASE_ADAPTER_KEY, event.base_model,
                        event.started_at)  # fmt: skip
        micros[rid] = micros.get(rid, 0) + to_micros(history.cost(event) or Decimal(0))
    return micros


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
