"""Metric: one loraplex_* Prometheus metric, recorded the Ray Serve way, or in memory outside Ray.

In a Ray worker each metric is a `ray.serve.metrics` object: inside a Serve replica Serve adds the
deployment, replica and application tags, and Ray's metrics agent exports it on the node's Prometheus port
as `ray_<name>` (counters also get `_total`). Outside Ray (the in-process test app, single-process tools)
the same calls land in MEMORY, which tests read. The Ray objects are made on first use, never at import:
Serve's tags come from the replica context, which exists only once the replica is being constructed.
"""

import threading
from collections.abc import Mapping, Sequence
from typing import Any, Literal

Kind = Literal["counter", "gauge", "histogram"]
SeriesKey = tuple[str, frozenset[tuple[str, str]]]

# Bucket boundaries, in milliseconds.
LATENCY_MS = (10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000, 120_000, 300_000)
TTFT_MS = (5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000)
TPOT_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_500)
QUEUE_MS = (1, 5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000)


class MemoryRecorder:
    """What would have been exported, kept in this process: counter totals, last gauge values, and every
    histogram observation, per series (metric name and tags)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[SeriesKey, float] = {}
        self._observations: dict[SeriesKey, list[float]] = {}

    def record(self, kind: Kind, name: str, value: float, tags: Mapping[str, str]) -> None:
        key = (name, frozenset(tags.items()))
        with self._lock:
            if kind == "counter":
                self._values[key] = self._values.get(key, 0.0) + value
            elif kind == "gauge":
                self._values[key] = value
            else:
                self._observations.setdefault(key, []).append(value)

    def value(self, name: str, **tags: str) -> float:
        """Summed over the series of `name` whose tags include `tags`."""
        with self._lock:
            return sum(v for key, v in self._values.items() if _matches(key, name, tags))

    def observations(self, name: str, **tags: str) -> list[float]:
        with self._lock:
            return [v for key, vs in self._observations.items() if _matches(key, name, tags) for v in vs]

    def series(self, name: str) -> list[dict[str, str]]:
        """The tag sets `name` was recorded with."""
        with self._lock:
            keys = [*self._values, *self._observations]
        return [dict(tags) for metric, tags in keys if metric == name]

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self._observations.clear()


def _matches(key: SeriesKey, name: str, tags: Mapping[str, str]) -> bool:
    return key[0] == name and all(item in key[1] for item in tags.items())


MEMORY = MemoryRecorder()


def _in_ray_worker() -> bool:
    import ray

    return ray.is_initialized()


class Metric:
    def __init__(
        self,
        kind: Kind,
        name: str,
        description: str,
        tag_keys: Sequence[str],
        boundaries: Sequence[float] = (),
    ) -> None:
        self.kind = kind
        self.name = name
        self.description = description
        self.tag_keys = tuple(tag_keys)
        self.boundaries = [float(b) for b in boundaries]
        self._ray: Any = None
        self._lock = threading.Lock()

    def record(self, value: float, tags: Mapping[str, str]) -> None:
        if set(tags) != set(self.tag_keys):  # as strict as Ray, so tests catch what production would
            raise ValueError(f"{self.name} takes tags {self.tag_keys}, got {sorted(tags)}")
        if self.kind == "counter" and value <= 0:  # Ray refuses non-positive increments
            return
        if _in_ray_worker():
            self._record_ray(float(value), dict(tags))
        else:
            MEMORY.record(self.kind, self.name, float(value), tags)

    def _ray_metric(self) -> Any:
        with self._lock:
            if self._ray is None:
                self._ray = _ray_metric(self)
            return self._ray

    def _record_ray(self, value: float, tags: dict[str, str]) -> None:
        impl = self._ray_metric()
        if self.kind == "counter":
            impl.inc(value, tags)
        elif self.kind == "gauge":
            impl.set(value, tags)
        else:
            impl.observe(value, tags)


def _ray_metric(metric: Metric) -> Any:
    """The `ray.serve.metrics` object behind a Metric, made in the process that records it."""
    from ray.serve import metrics

    keys: Any = metric.tag_keys  # Ray annotates tag_keys as Tuple[str] but takes any length
    if metric.kind == "counter":
        return metrics.Counter(metric.name, metric.description, tag_keys=keys)
    if metric.kind == "gauge":
        return metrics.Gauge(metric.name, metric.description, tag_keys=keys)
    return metrics.Histogram(metric.name, metric.description, boundaries=metric.boundaries, tag_keys=keys)


class Counter(Metric):
    def __init__(self, name: str, description: str, tag_keys: Sequence[str]) -> None:
        super().__init__("counter", name, description, tag_keys)

    def inc(self, tags: Mapping[str, str], value: float = 1.0) -> None:
        self.record(value, tags)


class Gauge(Metric):
    def __init__(self, name: str, description: str, tag_keys: Sequence[str]) -> None:
        super().__init__("gauge", name, description, tag_keys)

    def set(self, value: float, tags: Mapping[str, str]) -> None:
        self.record(value, tags)


class Histogram(Metric):
    def __init__(
        self, name: str, description: str, tag_keys: Sequence[str], boundaries: Sequence[float]
    ) -> None:
        super().__init__("histogram", name, description, tag_keys, boundaries)

    def observe(self, value: float, tags: Mapping[str, str]) -> None:
        self.record(value, tags)
