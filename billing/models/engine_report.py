"""The engine_reports table: one row per engine replica, its cumulative utilisation and routing counters.

deployments.engine_reporter writes it; billing.routing_report reads it.
"""

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Double, String
from sqlalchemy.orm import Mapped, mapped_column

from billing.models.base import Base, UTCDateTime, utcnow


class EngineReport(Base):
    """An engine replica's cumulative busy and wall time (utilisation) and routing quality."""

    __tablename__ = "engine_reports"

    replica: Mapped[str] = mapped_column(String(128), primary_key=True)
    base_model: Mapped[str] = mapped_column(String(128))
    busy_ms: Mapped[float] = mapped_column(Double)
    wall_ms: Mapped[float] = mapped_column(Double)
    steps: Mapped[int] = mapped_column(BigInteger)
    adapter_requests: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    adapter_hits: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")  # found resident
    adapter_loads: Mapped[dict[str, int] | None] = mapped_column(JSON)  # "name@vN" -> reads from the store
    # Tenant isolation inside the replica (deployments/engine_reporter.py ISOLATION_FIELDS), for
    # GET /admin/engines: service, waiting and oldest wait per tenant, preemptions, adapter queues, ranks.
    isolation: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
