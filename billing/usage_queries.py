"""Live usage: the metered requests of a period, aggregated straight from usage_events.

Unlike a bill (billing.pricing, made of the hourly rollups of closed hours), this sees every request as
soon as it is recorded, the current hour included; it is for dashboards and the usage API, not invoicing.

A request belongs to the UTC hour in which it started (billing.usage.hour_expression, as in the rollups),
and to a period [start, end) when start <= started_at < end. Grouping, always within a tenant (the admin
view across tenants adds the tenant to every key):
- "hour": per UTC hour (hours without requests are left out);
- "model": per base model;
- "adapter": per (base model, adapter), requests without an adapter as the adapter "base";
- "batch": per Batch API batch (usage_events.batch_id), interactive requests together as batch None: the
  batch-vs-interactive split and each batch's own usage in one grouping, with no new endpoint.
"""

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, get_args

from sqlalchemy import ColumnElement, Row, func, select
from sqlalchemy.orm import InstrumentedAttribute, Session

from billing.models import BASE_ADAPTER_KEY, UsageEvent
from billing.pricing import adapter_names
from billing.usage import as_hour, hour_expression, requests_count

GroupBy = Literal["hour", "adapter", "model", "batch"]
GROUP_BY_VALUES: tuple[str, ...] = get_args(GroupBy)


@dataclass(frozen=True)
class UsageRow:
    """One group's usage. Fields outside the grouping are None (e.g. `hour` unless grouped by hour)."""

    tenant_id: str
    hour: datetime | None
    base_model: str | None
    adapter_id: str | None  # grouped by adapter: None for the base model itself
    adapter: str | None  # grouped by adapter: the adapter's name, or "base"
    batch_id: str | None  # grouped by batch: the Batch API batch; None for interactive requests
    requests: int
    prompt_tokens: int  # cached tokens included, as in OpenAI's usage
    cached_tokens: int
    completion_tokens: int
    gpu_ms: float


def usage(
    session: Session,
    *,
    tenant_id: str | None,
    start: datetime,
    end: datetime,
    group_by: GroupBy,
) -> list[UsageRow]:
    """One tenant's usage (tenant_id), or every tenant's (None: the admin view), in [start, end), ordered
    by tenant and then by the group (hour; base model; base model, the base model's own row first, then
    adapter name; interactive requests first, then batch id). Raises ValueError for an unknown group_by."""
    if group_by not in GROUP_BY_VALUES:
        raise ValueError(f"group_by must be one of {', '.join(GROUP_BY_VALUES)}, got {group_by!r}")
    keys: list[ColumnElement[Any] | InstrumentedAttribute[Any]] = [UsageEvent.tenant_id]
    if group_by == "hour":
        keys.append(hour_expression(session).label("hour"))
    elif group_by == "batch":
        keys.append(UsageEvent.batch_id)
    else:
        keys.append(UsageEvent.base_model)
    if group_by == "adapter":
        keys.append(func.coalesce(UsageEvent.adapter_id, BASE_ADAPTER_KEY).label("adapter_key"))
    query = (
        select(
            *keys,
            requests_count().label("requests"),
            func.coalesce(func.sum(UsageEvent.prompt_tokens), 0).label("prompt_tokens"),
            func.coalesce(func.sum(UsageEvent.cached_tokens), 0).label("cached_tokens"),
            func.coalesce(func.sum(UsageEvent.completion_tokens), 0).label("completion_tokens"),
            func.coalesce(func.sum(UsageEvent.gpu_ms), 0.0).label("gpu_ms"),
        )
        .where(UsageEvent.started_at >= _utc(start), UsageEvent.started_at < _utc(end))
        .group_by(*keys)
    )
    if tenant_id is not None:
        query = query.where(UsageEvent.tenant_id == tenant_id)
    rows = session.execute(query).all()
    names = (
        adapter_names(session, {r.adapter_key for r in rows if r.adapter_key != BASE_ADAPTER_KEY})
        if group_by == "adapter"
        else {}
    )
    result = [_usage_row(row, group_by, names) for row in rows]
    result.sort(key=_order)
    return result


def _usage_row(row: Row[*tuple[Any, ...]], group_by: GroupBy, names: dict[str, str]) -> UsageRow:
    adapter_id: str | None = None
    adapter: str | None = None
    if group_by == "adapter":
        adapter_id = None if row.adapter_key == BASE_ADAPTER_KEY else str(row.adapter_key)
        adapter = BASE_ADAPTER_KEY if adapter_id is None else names.get(adapter_id, adapter_id)
    return UsageRow(
        tenant_id=str(row.tenant_id),
        hour=as_hour(row.hour) if group_by == "hour" else None,
        base_model=str(row.base_model) if group_by in ("model", "adapter") else None,
        adapter_id=adapter_id,
        adapter=adapter,
        batch_id=None if group_by != "batch" or row.batch_id is None else str(row.batch_id),
        requests=int(row.requests),
        prompt_tokens=int(row.prompt_tokens),
        cached_tokens=int(row.cached_tokens),
        completion_tokens=int(row.completion_tokens),
        gpu_ms=float(row.gpu_ms),
    )


def _order(row: UsageRow) -> tuple[Any, ...]:
    return (
        row.tenant_id,
        row.hour or datetime.min.replace(tzinfo=UTC),
        row.base_model or "",
        row.adapter_id is not None,
        row.adapter or "",
        row.adapter_id or "",
        row.batch_id is not None,
        row.batch_id or "",
    )


def _utc(moment: datetime) -> datetime:
    """Naive means UTC (UTCDateTime refuses naive values)."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment
