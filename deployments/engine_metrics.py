"""EngineMetrics: an engine replica's load and adapter residency as Prometheus metrics, refreshed from
EngineStats every few seconds by a small thread.

Gauges take the current values; counters follow the engine's cumulative totals by their increments since
the last refresh (a Prometheus counter only ever goes up, and Ray's Counter takes increments). Inside a
Serve replica Serve adds the deployment and replica tags; base_model names the model.
"""

import collections
import logging
import threading
from typing import Protocol

from app.metrics import Counter, Gauge
from deployments.engine.interface import EngineStats

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
ADAPTER_READ_WAITS = Counter(
    "loraplex_engine_adapter_read_waits",
    "Store reads of cold adapters that admission waited for, so their requests started a step sooner "
    "(adapter_read_wait_s).",
    TAGS,
)
ADAPTER_LOAD_FAILURES = Counter(
    "loraplex_engine_adapter_load_failures",
    "Failed loads of an adapter version into CPU memory (store down, files missing or corrupt).",
    (*TAGS, "adapter"),
)
ADAPTER_LOAD_RETRIES = Counter(
    "loraplex_engine_adapter_load_retries",
    "Loads of an adapter version tried again after its backoff from a failure.",
    (*TAGS, "adapter"),
)
ABORTS = Counter("loraplex_engine_aborts", "Requests aborted (their caller left) before finishing.", TAGS)
GENERATED_TOKENS = Counter("loraplex_engine_generated_tokens", "Output tokens sampled.", TAGS)
PREEMPTIONS = Counter("loraplex_engine_preemptions", "Sequences preempted, for any reason.", TAGS)
PREEMPTIONS_BY_REASON = Counter(
    "loraplex_engine_preemptions_by_reason",
    "Sequences preempted, by reason: kv (KV blocks ran out), adapter_slot (a slot taken for an adapter past "
    "its wait bound), fair (a row taken for a tenant past the fair wait bound).",
    (*TAGS, "reason"),
)
TENANT_SERVICE = Gauge(
    "loraplex_engine_tenant_service",
    "Weighted service served per tenant since the replica started (the fair order's counters).",
    (*TAGS, "tenant"),
)
GRAMMAR_REFUSALS = Counter(
    "loraplex_engine_grammar_refusals",
    "Structured-output requests refused while compiling their grammar, by reason: schema (it cannot be "
    "enforced), timeout (its compile passed the bound, or did recently), busy (no grammar thread in time).",
    (*TAGS, "reason"),
)
TENANT_WAITING = Gauge(
    "loraplex_engine_tenant_waiting", "Sequences waiting per tenant (0 once none waits).", (*TAGS, "tenant")
)
TENANT_OLDEST_WAIT = Gauge(
    "loraplex_engine_tenant_oldest_wait_seconds",
    "How long each tenant's oldest waiting sequence has waited (0 once none waits).",
    (*TAGS, "tenant"),
)
ADAPTER_QUEUE = Gauge(
    "loraplex_engine_adapter_queue",
    "Sequences waiting per adapter version, for the engine's stats_top_adapters deepest queues only (0 once "
    "it waits no more or is no longer among them): the adapter label stays bounded.",
    (*TAGS, "adapter"),
)
ADAPTER_QUEUE_OTHER = Gauge(
    "loraplex_engine_adapter_queue_other",
    "Sequences waiting for adapters beyond the deepest stats_top_adapters queues (summed).",
    TAGS,
)
ADAPTERS_QUEUED = Gauge("loraplex_engine_adapters_queued", "Adapter versions with sequences waiting.", TAGS)
ADAPTER_ROTATION = Gauge(
    "loraplex_engine_adapter_rotation_position",
    "An adapter's place in the rotation for device slots (1: the next to get one), for the first "
    "stats_top_adapters of it (0 once it left them).",
    (*TAGS, "adapter"),
)
RESIDENT_BY_RANK = Gauge(
    "loraplex_engine_resident_adapters_by_rank",
    "Adapter versions in device slots, by LoRA rank (0 once none of that rank is resident).",
    (*TAGS, "rank"),
)
ADAPTER_PAGES = Gauge(
    "loraplex_engine_adapter_pages",
    "Device adapter memory in pages of lora_page_rank rank units: total, and in use by resident adapters.",
    (*TAGS, "state"),
)
RESIDENT_RANK = Gauge(
    "loraplex_engine_resident_adapter_rank",
    "The LoRA rank of each adapter version in a device slot (0 once it left).",
    (*TAGS, "adapter"),
)
BUSY_SECONDS = Counter("loraplex_engine_busy_seconds", "Device time spent in engine steps.", TAGS)


class StatsSource(Protocol):
    """What the metrics read: an AsyncEngine, or the LLMEngine it drives."""

    def stats(self) -> EngineStats: ...


class EngineMetrics:
    def __init__(self, engine: StatsSource, *, base_model: str, interval_s: float = 5.0) -> None:
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
        ADAPTER_READ_WAITS.inc(tags, stats.adapter_read_waits - (last.adapter_read_waits if last else 0))
        PREEMPTIONS.inc(tags, stats.preemptions - (last.preemptions if last else 0))
        ABORTS.inc(tags, stats.aborts - (last.aborts if last else 0))
        GENERATED_TOKENS.inc(tags, stats.generated_tokens - (last.generated_tokens if last else 0))
        BUSY_SECONDS.inc(tags, stats.busy_seconds - (last.busy_seconds if last else 0.0))
        before = last.preemptions_by_reason if last else {}
        for reason, count in stats.preemptions_by_reason.items():
            PREEMPTIONS_BY_REASON.inc({**tags, "reason": reason}, count - before.get(reason, 0))
        for tenant, service in stats.tenant_service.items():
            TENANT_SERVICE.set(service, {**tags, "tenant": tenant})
        ADAPTER_QUEUE_OTHER.set(stats.adapter_queue_other, tags)
        ADAPTERS_QUEUED.set(stats.adapters_queued, tags)
        for state in ("total", "in_use"):
            ADAPTER_PAGES.set(stats.adapter_pages.get(state, 0), {**tags, "state": state})
        per_key = (
            (TENANT_WAITING, "tenant", stats.tenant_waiting, last.tenant_waiting if last else {}),
            (
                TENANT_OLDEST_WAIT,
                "tenant",
                stats.tenant_oldest_wait_s,
                last.tenant_oldest_wait_s if last else {},
            ),
            (ADAPTER_QUEUE, "adapter", stats.adapter_queue, last.adapter_queue if last else {}),
            (RESIDENT_RANK, "adapter", stats.resident_ranks, last.resident_ranks if last else {}),
            (ADAPTER_ROTATION, "adapter", _positions(stats), _positions(last) if last else {}),
            (RESIDENT_BY_RANK, "rank", _by_rank(stats), _by_rank(last) if last else {}),
        )
        for gauge, label, now_values, before_values in per_key:
            for key in before_values.keys() - now_values.keys():  # gone since the last export: zero it
                gauge.set(0, {**tags, label: key})
            for key, value in now_values.items():
                gauge.set(value, {**tags, label: key})
        per_adapter = (
            (ADAPTER_DISK_LOADS, stats.adapter_disk_loads, last.adapter_disk_loads if last else {}),
            (ADAPTER_LOAD_FAILURES, stats.adapter_load_failures, last.adapter_load_failures if last else {}),
            (ADAPTER_LOAD_RETRIES, stats.adapter_load_retries, last.adapter_load_retries if last else {}),
        )
        for counter, now, before in per_adapter:
            for ref, count in now.items():
                counter.inc({**tags, "adapter": ref}, count - before.get(ref, 0))
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


def _positions(stats: EngineStats) -> dict[str, int]:
    return {ref: place for place, ref in enumerate(stats.adapter_rotation, start=1)}


def _by_rank(stats: EngineStats) -> dict[str, int]:
    return {str(rank): count for rank, count in collections.Counter(stats.resident_ranks.values()).items()}
