"""AdapterSpecs: each adapter version's parsed config, read from the store once, off the engine loop.

Reading a spec is store I/O (on an object store a HEAD and a GET, with the client's retries), so it runs on
a small pool of its own, never on the engine loop thread: a slow or failing store holds up only the
requests that name a version not read yet, never the decode steps of everyone else. Concurrent requests
for one version share one read. A failed read is not remembered: the next request tries again (the store
may be back), and concurrent ones still share it.
"""

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from adapters.ref import AdapterRef
from adapters.spec import AdapterSpec

SpecReader = Callable[[AdapterRef], AdapterSpec]


class AdapterSpecs:
    def __init__(self, reader: SpecReader, *, max_workers: int = 4) -> None:
        self._reader = reader
        self._max_workers = max_workers
        self._lock = threading.Lock()
        self._specs: dict[AdapterRef, AdapterSpec] = {}
        self._reading: dict[AdapterRef, Future[AdapterSpec]] = {}
        self._pool: ThreadPoolExecutor | None = None  # made on the first read

    def cached(self, ref: AdapterRef) -> AdapterSpec | None:
        with self._lock:
            return self._specs.get(ref)

    def fetch(self, ref: AdapterRef) -> "Future[AdapterSpec]":
        """The spec of `ref`: a done future when it is cached, else the read in flight (started if none)."""
        with self._lock:
            spec = self._specs.get(ref)
            if spec is not None:
                done: Future[AdapterSpec] = Future()
                done.set_result(spec)
                return done
            pending = self._reading.get(ref)
            if pending is None or pending.cancelled():  # a cancelled read never runs: start another
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="adapter-spec")
                pending = self._pool.submit(self._read, ref)
                self._reading[ref] = pending
            return pending

    def read(self, ref: AdapterRef) -> AdapterSpec:
        """`fetch`, waited for: blocks on store I/O the first time (never call it on the engine loop)."""
        return self.fetch(ref).result()

    def forget(self, adapter_id: str) -> None:
        with self._lock:
            for ref in [r for r in self._specs if r.adapter_id == adapter_id]:
                del self._specs[ref]

    def known(self) -> set[AdapterRef]:
        with self._lock:
            return set(self._specs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _read(self, ref: AdapterRef) -> AdapterSpec:
        try:
            spec = self._reader(ref)
        except BaseException:
            with self._lock:
                self._reading.pop(ref, None)
            raise
        with self._lock:
            self._reading.pop(ref, None)
            self._specs[ref] = spec
        return spec
