"""Batch line metrics, by tenant: lines claimed and ended (counters, per ingress replica's runner), and
lines queued and running now (gauges), recorded by the runner (app/batches/runner.py).

Queued lines are counted in the database, which every replica shares: each replica reports the same
number, so read it with max(), not sum(). Running lines are the replica's own: sum() over replicas.
"""

from collections.abc import Mapping

from app.metrics import Counter, Gauge

TENANT = ("tenant",)

LINES_CLAIMED = Counter(
    "loraplex_batch_lines_claimed",
    "Batch lines a runner claimed to run (a line tried again counts again).",
    TENANT,
)
LINES_ENDED = Counter(
    "loraplex_batch_lines_ended",
    "Batch lines a runner ended: done (output file), failed (error file), or requeued (the platform failed "
    "it; it is tried again).",
    (*TENANT, "outcome"),
)
LINES_QUEUED = Gauge(
    "loraplex_batch_lines_queued",
    "Lines of batches in progress waiting to run (or whose runner died), from the database: every replica "
    "reports the same number.",
    TENANT,
)
LINES_RUNNING = Gauge("loraplex_batch_lines_running", "Batch lines this replica's runner runs now.", TENANT)


class TenantGauge:
    """Sets a by-tenant gauge from a full count each time: a tenant missing from a count is set to 0 once,
    so its series does not stay at its last value after its lines are gone."""

    def __init__(self, gauge: Gauge) -> None:
        self.gauge = gauge
        self._shown: set[str] = set()

    def report(self, counts: Mapping[str, int]) -> None:
        for tenant in self._shown - set(counts):
            self.gauge.set(0, {"tenant": tenant})
        for tenant, count in counts.items():
            self.gauge.set(count, {"tenant": tenant})
        self._shown = {tenant for tenant, count in counts.items() if count}
