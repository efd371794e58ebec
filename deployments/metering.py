"""Metering: the Ray Serve deployment that writes usage records into the billing database in batches,
and keeps hourly rollups (and the Stripe export, when configured) up to date; ServeMeteringSink is the
ingress's side of it (app/metering/ draws the whole pipeline).

Writes are insert-or-ignore on the request id, so the ingress outboxes can retry freely. The periodic job is
idempotent (rollups are recomputed; Stripe identifiers are deterministic), so several replicas may run it.
"""

import asyncio
import logging
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

from ray.serve.handle import DeploymentHandle

from app import log_context
from app.dependency_noise import quiet_dependencies
from app.metering.database_sink import DatabaseSink
from app.settings import Settings
from billing.db import make_engine, make_session_factory
from billing.usage import UsageRecord, closed_before, rollup_hours

log = logging.getLogger(__name__)


class Metering:
    def __init__(self, *, rollup_interval_s: float = 300.0, rollup_lookback_h: int = 6) -> None:
        log_context.route_to_serve()
        quiet_dependencies()  # before this replica imports the ML stack
        settings = Settings()
        self.sessions = make_session_factory(make_engine(settings.resolved_database_url()))
        self.sink = DatabaseSink(self.sessions)
        self.batches = 0
        self.failed_batches = 0
        self.interval = rollup_interval_s
        self.lookback = timedelta(hours=rollup_lookback_h)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._periodic, name="metering-periodic", daemon=True)
        self._thread.start()

    async def record(self, records: list[UsageRecord]) -> int:
        """Store a batch; ids already stored are ignored. Raises if the database is unavailable."""
        try:
            stored = await self.sink.record(records)
        except Exception:
            self.failed_batches += 1
            raise
        self.batches += 1
        return stored

    def stats(self) -> dict[str, int]:
        """Batches stored and batches refused (the database was away) since this replica started."""
        return {"batches": self.batches, "failed_batches": self.failed_batches}

    def run_periodic_once(self) -> None:
        """Recompute the rollups of recent closed hours; export them to Stripe if it is configured."""
        now = datetime.now(UTC)
        with self.sessions() as session, session.begin():
            rollup_hours(session, start=now - self.lookback, end=closed_before(now))
        try:
            from billing.stripe_config import StripeConfig
            from billing.stripe_export import export_usage
        except ImportError:  # pragma: no cover - the exporter ships with the billing package
            return
        config = StripeConfig()
        if config.api_key.get_secret_value():
            summary = export_usage(self.sessions, config)
            log.info("stripe export: %s", summary)

    def _periodic(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.run_periodic_once()
            except Exception:  # the database or Stripe may be away for a while: try again next time
                log.exception("periodic rollup/export failed")

    def stop(self) -> None:
        """End the periodic job (Serve drops the replica; tests)."""
        self._stop.set()

    def __del__(self) -> None:
        if hasattr(self, "_stop"):
            self.stop()


class ServeMeteringSink:
    """The ingress's metering sink (app.metering.delivery.MeteringSink): a call to the Metering
    deployment, bounded by a timeout."""

    def __init__(self, handle: DeploymentHandle[Any], *, timeout_s: float = 30.0) -> None:
        self._handle = handle
        self._timeout = timeout_s

    async def record(self, records: list[UsageRecord]) -> int:
        count: int = await asyncio.wait_for(self._handle.record.remote(records), self._timeout)
        return count
