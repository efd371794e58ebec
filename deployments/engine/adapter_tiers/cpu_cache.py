"""CpuAdapterCache: adapters in host memory (LRU, pinnable), loaded from the store off the engine thread.

A load runs in a worker thread so the engine keeps stepping; only the request that needs the adapter
waits. A failed load is remembered for a backoff (doubling per consecutive failure, up to a bound): the
requests waiting on it, and those arriving meanwhile, finish with its error at once instead of hanging or
hammering a store that just failed; once the backoff has passed the next request or prefetch loads it
again, so a store brownout or a repaired file does not fail a version forever on this replica.
"""

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from adapters.ref import AdapterRef
from adapters.weights import AdapterWeights

Loader = Callable[[AdapterRef], AdapterWeights]


@dataclass(slots=True)
class _Failure:
    error: Exception
    retry_at: float  # clock time from which a load may be tried again
    failures: int  # consecutive failed loads: the next backoff doubles with each


class CpuAdapterCache:
    def __init__(
        self,
        loader: Loader,
        *,
        capacity: int,
        max_workers: int = 2,
        retry_s: float = 1.0,
        retry_max_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._loader = loader
        self.capacity = capacity
        self.retry_s = retry_s
        self.retry_max_s = retry_max_s
        self._clock = clock
        self._lock = threading.Lock()
        self._ready: OrderedDict[AdapterRef, AdapterWeights] = OrderedDict()  # least recently used first
        self._loading: dict[AdapterRef, Future[AdapterWeights]] = {}
        self._failed: dict[AdapterRef, _Failure] = {}
        self._pinned: set[AdapterRef] = set()
        self._wanted: frozenset[AdapterRef] = frozenset()  # queued requests need them: evicted last
        self._cancelled: set[AdapterRef] = set()  # removed while loading: not to be cached
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="adapter-load")
        self.loads = 0
        self.load_seconds = 0.0
        self.load_failures: Counter[str] = Counter()  # ref -> failed loads
        self.load_retries: Counter[str] = Counter()  # ref -> loads started again after a failure
        self.loaded_at: dict[AdapterRef, float] = {}  # ref -> clock time its last load finished
        self.recent_load_s = 0.0  # a moving average of successful loads' durations (0 before the first)

    def get(self, ref: AdapterRef) -> AdapterWeights | None:
        """Weights if resident (marks them recently used), else None. Raises the error of a failed load
        while its backoff lasts."""
        with self._lock:
            weights = self._ready.get(ref)
            if weights is not None:
                self._ready.move_to_end(ref)
                return weights
            failure = self._backing_off(ref)
        if failure is not None:
            raise failure.error
        return None

    def raise_if_failed(self, ref: AdapterRef) -> None:
        """Raise the error of a failed load while its backoff lasts."""
        with self._lock:
            failure = self._backing_off(ref)
        if failure is not None:
            raise failure.error

    def is_ready(self, ref: AdapterRef) -> bool:
        with self._lock:
            return ref in self._ready

    def needs_load(self, ref: AdapterRef) -> bool:
        """Neither resident, nor loading, nor failed within its backoff."""
        with self._lock:
            return ref not in self._ready and ref not in self._loading and self._backing_off(ref) is None

    def prefetch(self, ref: AdapterRef) -> Future[AdapterWeights] | None:
        """Start loading `ref` unless it is resident, already loading, or failed within its backoff.
        Returns the pending load, if any."""
        with self._lock:
            if ref in self._ready or self._backing_off(ref) is not None:
                return None
            pending = self._loading.get(ref)
            if pending is not None:
                return pending
            if ref in self._failed:
                self.load_retries[str(ref)] += 1
            future = self._pool.submit(self._load, ref)
            self._loading[ref] = future
            return future

    def pin(self, ref: AdapterRef) -> None:
        with self._lock:
            self._pinned.add(ref)

    def want(self, refs: frozenset[AdapterRef]) -> None:
        """The adapters queued requests need: eviction takes them only when nothing else is left."""
        with self._lock:
            self._wanted = refs

    def unpin(self, ref: AdapterRef) -> None:
        with self._lock:
            self._pinned.discard(ref)

    def fail(self, ref: AdapterRef, error: Exception) -> None:
        """Drop `ref`'s weights and treat it as a failed load (they could not be used: see the manager)."""
        with self._lock:
            self._ready.pop(ref, None)
            self._record_failure(ref, error)

    def remove(self, adapter_id: str) -> None:
        with self._lock:
            for ref in [r for r in self._ready if r.adapter_id == adapter_id]:
                del self._ready[ref]
            for ref in [r for r in self._failed if r.adapter_id == adapter_id]:
                del self._failed[ref]
            for ref in [r for r in self.loaded_at if r.adapter_id == adapter_id]:
                del self.loaded_at[ref]
            self._pinned = {r for r in self._pinned if r.adapter_id != adapter_id}
            self._cancelled.update(r for r in self._loading if r.adapter_id == adapter_id)

    def resident(self) -> list[AdapterRef]:
        with self._lock:
            return list(self._ready)

    def loading(self) -> list[AdapterRef]:
        with self._lock:
            return list(self._loading)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _backing_off(self, ref: AdapterRef) -> _Failure | None:
        """The failure of `ref`'s last load while its backoff lasts (hold the lock)."""
        failure = self._failed.get(ref)
        return failure if failure is not None and self._clock() < failure.retry_at else None

    def _record_failure(self, ref: AdapterRef, error: Exception) -> None:
        previous = self._failed.get(ref)
        failures = 1 if previous is None else previous.failures + 1
        backoff = min(self.retry_max_s, self.retry_s * 2 ** (failures - 1))
        self._failed[ref] = _Failure(error, self._clock() + backoff, failures)
        self.load_failures[str(ref)] += 1

    def _load(self, ref: AdapterRef) -> AdapterWeights:
        start = time.perf_counter()
        try:
            weights = self._loader(ref)
        except Exception as error:
            with self._lock:
                self._loading.pop(ref, None)
                if ref not in self._cancelled:
                    self._record_failure(ref, error)
                self._cancelled.discard(ref)
            raise
        with self._lock:
            self._loading.pop(ref, None)
            self._failed.pop(ref, None)
            took = time.perf_counter() - start
            self.loads += 1
            self.load_seconds += took
            self.recent_load_s = took if self.loads == 1 else 0.8 * self.recent_load_s + 0.2 * took
            self.loaded_at[ref] = self._clock()
            if ref in self._cancelled:  # the adapter was removed while it loaded
                self._cancelled.discard(ref)
                return weights
            self._ready[ref] = weights
            self._evict_over_capacity(keep=ref)
        return weights

    def _evict_over_capacity(self, keep: AdapterRef) -> None:
        """LRU eviction, adapters that queued requests want last; never a pinned ref or the one just loaded
        (pins may overfill the cache)."""
        for spare_wanted in (True, False):
            for ref in list(self._ready):
                if len(self._ready) <= self.capacity:
                    return
                if ref in self._pinned or ref == keep or (spare_wanted and ref in self._wanted):
                    continue
                del self._ready[ref]
