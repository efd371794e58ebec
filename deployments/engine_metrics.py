"""EngineMetrics: an engine replica's load and adapter residency as Prometheus metrics, refreshed from
EngineStats every few seconds by a small thread.

Gauges take the current values; counters follow the engine's cumulative totals by their increments since
the last refresh (a Prometheus counter only ever goes up, and Ray's Counter takes increments). Inside a
Serve replica Serve adds the deployment and replica tags; base_model names the model.
"""

import logging
import threading
from typing import TYPE_CHECKING

from app.metrics import Counter, Gauge
from deployments.engine.interface import EngineStats

if TYPE_CHECKING:  # the engine's model stack is imported by the replica that runs it, not by this module
    from deployments.engine.interface import AsyncEngine

log = logging.getLogger(__name__)
TAGS = ("base_model",)

RUNNING = Gauge("loraplex_engine_running", "Sequences running (in the batch).", TAGS)
WAITING = Gauge("loraplex_engine_waiting", "Sequences waiting to be scheduled.", TAGS)
KV_USAGE = Gauge("loraplex_engine_kv_usage", "Fraction of KV cache blocks in use.", TAGS)
DEVICE_ADAPTERS = Gauge("loraplex_engine_device_adapters", "Adapters in device slots.", TAGS)
CPU_ADAPTERS = Gauge("loraplex_engine_cpu_adapters", "Adapters held in CPU memory.", TAGS)
PREFIX_HIT_RATE = Gauge("loraplex_engine_prefix_hit_rate", "Prefix cache hits per lookup.", TAGS)
ADAPTER_HIT_RATE = Gauge(
    "loraplex_engine_adapter_hit_rate",
    "Share of adapter requests that found their adapter here (slot, CPU or loading), since start.",
    TAGS,
)
ADAPTER_LOADS = Counter("loraplex_engine_adapter_loads", "Adapter loads into device slots.", TAGS)
ADAPTER_EVICTIONS = Counter("loraplex_engine_adapter_evictions", "Adapters evicted from device slots.", TAGS)
ADAPTER_REQUESTS = Counter("loraplex_engine_adapter_requests", "Requests that named an adapter.", TAGS)
ADAPTER_HITS = Counter(
    "loraplex_engine_adapter_hits", "Adapter requests that found their adapter here already.", TAGS
)
ADAPTER_DISK_LOADS = Counter(
    "loraplex_engine_adapter_disk_loads",
    "Adapter reads from the store, per adapter version.",
    (*TAGS, "adapter"),
)
ABORTS = Counter("loraplex_engine_aborts", "Requests aborted (their caller left) before finishing.", TAGS)
GENERATED_TOKENS = Counter("loraplex_engine_generated_tokens", "Output tokens sampled.", TAGS)
PREEMPTIONS = Counter("loraplex_engine_preemptions", "Sequences preempted for KV cache space.", TAGS)
GRAMMAR_REFUSALS = Counter(
    "loraplex_engine_grammar_refusals",
    "Structured-output requests refused while compiling their grammar, by reason: schema (it cannot be "
    "enforced), timeout (its compile passed the bound, or did recently), busy (no grammar thread in time).",
    (*TAGS, "reason"),
)
BUSY_SECONDS = Counter("loraplex_engine_busy_seconds", "Device time spent in engine steps.", TAGS)


class EngineMetrics:
    def __init__(self, engine: "AsyncEngine", *, base_model: str, interval_s: float = 5.0) -> None:
        self._engine = engine
        self._tags = {"base_model": base_model}
        self._interval = interval_s
        self._last: EngineStats | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-metrics", daemon=True)

    def start(self) -> None:
        self._refresh()  # at once: the gauges exist from the replica's first moment
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def export_once(self) -> None:
        stats = self._engine.stats()
        tags = self._tags
        RUNNING.set(stats.running, tags)
        WAITING.set(stats.waiting, tags)
        KV_USAGE.set(stats.kv_usage, tags)
        DEVICE_ADAPTERS.set(len(stats.device_adapters), tags)
        CPU_ADAPTERS.set(len(stats.cpu_adapters), tags)
        PREFIX_HIT_RATE.set(stats.prefix_hit_rate, tags)
        ADAPTER_HIT_RATE.set(stats.adapter_arrival_hits / max(1, stats.adapter_requests), tags)
        last = self._last
        ADAPTER_LOADS.inc(tags, stats.adapter_loads - (last.adapter_loads if last else 0))
        ADAPTER_EVICTIONS.inc(tags, stats.adapter_evictions - (last.adapter_evictions if last else 0))
        ADAPTER_REQUESTS.inc(tags, stats.adapter_requests - (last.adapter_requests if last else 0))
        ADAPTER_HITS.inc(tags, stats.adapter_arrival_hits - (last.adapter_arrival_hits if last else 0))
        PREEMPTIONS.inc(tags, stats.preemptions - (last.preemptions if last else 0))
        ABORTS.inc(tags, stats.aborts - (last.aborts if last else 0))
        GENERATED_TOKENS.inc(tags, stats.generated_tokens - (last.generated_tokens if last else 0))
        BUSY_SECONDS.inc(tags, stats.busy_seconds - (last.busy_seconds if last else 0.0))
        before = last.adapter_disk_loads if last else {}
        for ref, reads in stats.adapter_disk_loads.items():
            ADAPTER_DISK_LOADS.inc({**tags, "adapter": ref}, reads - before.get(ref, 0))
        refused_before = last.grammar_refusals if last else {}
        for reason, refused in stats.grammar_refusals.items():
            GRAMMAR_REFUSALS.inc({**tags, "reason": reason}, refused - refused_before.get(reason, 0))
        self._last = stats

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._refresh()

    def _refresh(self) -> None:
        try:
            self.export_once()
        except Exception:  # stats read across threads may race a change: the next round catches up
            log.debug("engine metrics refresh failed", exc_info=True)
