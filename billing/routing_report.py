"""Routing quality across engine replicas, from their reports (EngineReport rows).

Per replica: requests that named an adapter, how many found it already resident (a routing hit), and the
store reads per adapter version. Per base model: the hit rate, the loads, and the waste a router exists to
avoid: the same adapter version loaded on more than one replica.
"""

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.models import EngineReport, utcnow


@dataclass(frozen=True, slots=True)
class ReplicaRouting:
    replica: str
    base_model: str
    adapter_requests: int
    adapter_hits: int
    adapter_loads: dict[str, int]  # "name@vN" -> store reads on this replica
    reported_at: datetime

    @property
    def hit_rate(self) -> float | None:
        return self.adapter_hits / self.adapter_requests if self.adapter_requests else None

    @property
    def loads(self) -> int:
        return sum(self.adapter_loads.values())


@dataclass(frozen=True, slots=True)
class ModelRouting:
    base_model: str
    replicas: list[ReplicaRouting] = field(default_factory=list)

    @property
    def adapter_requests(self) -> int:
        return sum(r.adapter_requests for r in self.replicas)

    @property
    def adapter_hits(self) -> int:
        return sum(r.adapter_hits for r in self.replicas)

    @property
    def hit_rate(self) -> float | None:
        return self.adapter_hits / self.adapter_requests if self.adapter_requests else None

    @property
    def loads(self) -> int:
        return sum(r.loads for r in self.replicas)

    @property
    def replicas_per_adapter(self) -> dict[str, int]:
        """Adapter version -> how many replicas loaded it."""
        spread: dict[str, int] = {}
        for replica in self.replicas:
            for ref, count in replica.adapter_loads.items():
                if count:
                    spread[ref] = spread.get(ref, 0) + 1
        return spread

    @property
    def duplicate_loads(self) -> int:
        """Loads of an adapter version on a replica beyond the first replica that loaded it."""
        return sum(n - 1 for n in self.replicas_per_adapter.values())


def live_replicas(session: Session, *, base_model: str, within: timedelta) -> list[str]:
    """Names of the base model's replicas that reported within `within`."""
    query = select(EngineReport.replica).where(
        EngineReport.base_model == base_model, EngineReport.updated_at >= utcnow() - within
    )
    return list(session.scalars(query))


def routing_report(
    session: Session, *, base_model: str | None = None, within: timedelta | None = None
) -> list[ModelRouting]:
    """Every base model's routing quality, from replicas that reported within `within` (default: all)."""
    query = select(EngineReport).order_by(EngineReport.base_model, EngineReport.replica)
    if base_model is not None:
        query = query.where(EngineReport.base_model == base_model)
    if within is not None:
        query = query.where(EngineReport.updated_at >= utcnow() - within)
    models: dict[str, ModelRouting] = {}
    for row in session.scalars(query):
        replica = ReplicaRouting(
            replica=row.replica,
            base_model=row.base_model,
            adapter_requests=row.adapter_requests,
            adapter_hits=row.adapter_hits,
            adapter_loads=dict(row.adapter_loads or {}),
            reported_at=row.updated_at,
        )
        models.setdefault(row.base_model, ModelRouting(row.base_model)).replicas.append(replica)
    return list(models.values())
