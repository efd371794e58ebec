"""CpuAdapterCache: adapters in host memory (LRU, pinnable), loaded from the store off the engine thread.

A load runs in a worker thread so the engine keeps stepping; only the request that needs the adapter
waits. Failed loads are remembered so the waiting requests can finish with the error instead of hanging.
"""

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from adapters.ref import AdapterRef
from adapters.weights import AdapterWeights

Loader = Callable[[AdapterRef], AdapterWeights]


class CpuAdapterCache:
    def __init__(self, loader: Loader, *, capacity: int, max_workers: int = 2) -> None:
        self._loader = loader
        self.capacity = capacity
        self._lock = threading.Lock()
        self._ready: OrderedDict[AdapterRef, AdapterWeights] = OrderedDict()  # least recently used first
        self._loading: dict[AdapterRef, Future[AdapterWeights]] = {}
        self._failed: dict[AdapterRef, Exception] = {}
        self._pinned: set[AdapterRef] = set()
        self._wanted: frozenset[AdapterRef] = frozenset()  # queued requests need them: evicted last
        self._cancelled: set[AdapterRef] = set()  # removed while loading: not to be cached
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="adapter-load")
        self.loads = 0
        self.load_seconds = 0.0

    def get(self, ref: AdapterRef) -> AdapterWeights | None:
        """Weights if resident (marks them recently used), else None. Raises the error of a failed load."""
        with self._lock:
            weights = self._ready.get(ref)
            if weights is not None:
                self._ready.move_to_end(ref)
                return weights
            error = self._failed.get(ref)
        if error is not None:
            raise error
        return None

    def is_ready(self, ref: AdapterRef) -> bool:
        with self._lock:
            return ref in self._ready

    def needs_load(self, ref: AdapterRef) -> bool:
        """Neither resident, nor loading, nor failed (a failed load is retried on explicit prefetch)."""
        with self._lock:
            return ref not in self._ready and ref not in self._loading and ref not in self._failed

    def prefetch(self, ref: AdapterRef) -> Future[AdapterWeights] | None:
        """Start loading `ref` unless it is resident or already loading. Returns the pending load, if any."""
        with self._lock:
            if ref in self._ready:
                return None
            pending = self._loading.get(ref)
            if pending is not None:
                return pending
            self._failed.pop(ref, None)
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

    def remove(self, adapter_id: str) -> None:
        with self._lock:
            for table in (self._ready, self._failed):
                for ref in [r for r in table if r.adapter_id == adapter_id]:
                    del table[ref]
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

    def _load(self, ref: AdapterRef) -> AdapterWeights:
        start = time.perf_counter()
        try:
            weights = self._loader(ref)
        except Exception as error:
            with self._lock:
                self._loading.pop(ref, None)
                if ref not in self._cancelled:
                    self._failed[ref] = error
                self._cancelled.discard(ref)
            raise
        with self._lock:
            self._loading.pop(ref, None)
            self.loads += 1
            self.load_seconds += time.perf_counter() - start
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
