"""EngineReporter: an engine replica's cumulative busy and wall time, written to the billing database, so
utilisation can be shown and set against the GPU time billed to requests; and its routing counters
(adapter requests, hits, store reads per adapter version), which GET /admin/routing aggregates."""

import logging
import threading
from collections.abc import Callable

from sqlalchemy.orm import Session

from billing.models import EngineReport, utcnow
from deployments.engine_metrics import StatsSource

log = logging.getLogger(__name__)
# EngineStats' per-tenant and per-adapter figures a report carries (engine_reports.isolation).
ISOLATION_FIELDS = (
    "tenant_service",
    "tenant_waiting",
    "tenant_oldest_wait_s",
    "preemptions_by_reason",
    "adapter_queue",
    "resident_ranks",
    "adapter_pages",
)


class EngineReporter:
    def __init__(
        self,
        engine: StatsSource,
        *,
        replica: str,
        base_model: str,
        session_factory: Callable[[], Session],
        interval_s: float = 15.0,
    ) -> None:
        self._engine = engine
        self.replica = replica
        self.base_model = base_model
        self._sessions = session_factory
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-reporter", daemon=True)

    def start(self) -> None:
        try:
            self.report_once()
        except Exception:
            log.exception("engine report failed")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.report_once()

    def report_once(self) -> None:
        stats = self._engine.stats()
        with self._sessions() as session, session.begin():
            row = session.get(EngineReport, self.replica)
            if row is None:
                row = EngineReport(replica=self.replica, base_model=self.base_model)
                session.add(row)
            row.busy_ms = stats.busy_seconds * 1e3
            row.wall_ms = stats.wall_seconds * 1e3
            row.steps = stats.steps
            row.adapter_requests = stats.adapter_requests
            row.adapter_hits = stats.adapter_arrival_hits
            row.adapter_loads = dict(stats.adapter_disk_loads)
            row.isolation = {
                **{name: dict(getattr(stats, name)) for name in ISOLATION_FIELDS},
                "adapter_queue_other": stats.adapter_queue_other,
                "adapters_queued": stats.adapters_queued,
                "adapter_rotation": list(stats.adapter_rotation),
            }
            row.updated_at = utcnow()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.report_once()
            except Exception:  # the database may be away: the totals are cumulative, nothing is lost
                log.exception("engine report failed")
