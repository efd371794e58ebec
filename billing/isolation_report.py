"""Tenant isolation inside each engine replica, from the figures replicas report (engine_reports.isolation):
who was served how much, who waits and for how long, what was preempted and why, which adapters queue and
which ranks are resident in how much adapter memory. Read by GET /admin/engines."""

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.models import EngineReport, Tenant, utcnow


@dataclass(slots=True)
class TenantIsolation:
    tenant_id: str  # "" for requests with no tenant
    tenant_name: str | None  # None when the id is not a tenant here (or "")
    service: float
    waiting: int
    oldest_wait_s: float | None


@dataclass(slots=True)
class ReplicaIsolation:
    replica: str
    base_model: str
    reported_at: datetime
    tenants: list[TenantIsolation] = field(default_factory=list)
    preemptions: dict[str, int] = field(default_factory=dict)
    adapter_queue: dict[str, int] = field(default_factory=dict)
    resident_ranks: dict[str, int] = field(default_factory=dict)
    adapter_pages: dict[str, int] = field(default_factory=dict)
    adapter_queue_other: int = 0
    adapters_queued: int = 0
    adapter_rotation: list[str] = field(default_factory=list)


def isolation_report(
    session: Session, *, base_model: str | None = None, within: timedelta | None = None
) -> list[ReplicaIsolation]:
    """Every replica's isolation figures (those that reported within `within`; default: all), tenants by
    service served, most first."""
    query = select(EngineReport).order_by(EngineReport.base_model, EngineReport.replica)
    if base_model is not None:
        query = query.where(EngineReport.base_model == base_model)
    if within is not None:
        query = query.where(EngineReport.updated_at >= utcnow() - within)
    rows = list(session.scalars(query))
    figures = [row.isolation or {} for row in rows]
    ids = {t for f in figures for key in ("tenant_service", "tenant_waiting") for t in _map(f, key)}
    names = dict(session.execute(select(Tenant.id, Tenant.name).where(Tenant.id.in_(ids))).tuples().all())
    report = []
    for row, f in zip(rows, figures, strict=True):
        service, waiting, oldest = (
            _map(f, "tenant_service"),
            _map(f, "tenant_waiting"),
            _map(f, "tenant_oldest_wait_s"),
        )
        tenants = [
            TenantIsolation(
                t, names.get(t), float(service.get(t, 0.0)), int(waiting.get(t, 0)), oldest.get(t)
            )
            for t in sorted(service.keys() | waiting.keys(), key=lambda t: -float(service.get(t, 0.0)))
        ]
        report.append(
            ReplicaIsolation(
                replica=row.replica,
                base_model=row.base_model,
                reported_at=row.updated_at,
                tenants=tenants,
                preemptions=dict(_map(f, "preemptions_by_reason")),
                adapter_queue=dict(_map(f, "adapter_queue")),
                resident_ranks=dict(_map(f, "resident_ranks")),
                adapter_pages={k: v for k, v in _map(f, "adapter_pages").items() if isinstance(v, int)},
                adapter_queue_other=_int(f, "adapter_queue_other"),
                adapters_queued=_int(f, "adapters_queued"),
                adapter_rotation=[r for r in _list(f, "adapter_rotation") if isinstance(r, str)],
            )
        )
    return report


def _map(figures: dict[str, Any], key: str) -> dict[str, Any]:
    value = figures.get(key)
    return value if isinstance(value, dict) else {}


def _int(figures: dict[str, Any], key: str) -> int:
    value = figures.get(key)  # absent in reports from replicas older than the figure
    return value if isinstance(value, int) else 0


def _list(figures: dict[str, Any], key: str) -> list[Any]:
    value = figures.get(key)
    return value if isinstance(value, list) else []
