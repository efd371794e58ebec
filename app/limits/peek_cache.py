"""PeekCache: a tenant's `peek`, shared for a moment by everyone who asks.

GET /v1/limits (any tenant, as often as it likes) and the unauthenticated /readyz read the limiter; without
this, a loop of reads is a loop of round trips to the one shared limiter that every admission needs.
Here each tenant costs at most one peek per `ttl_s`, however many callers, and concurrent callers share
the one in flight. A failed peek is shared by those waiting on it, never kept for the next caller.
"""

import asyncio
import time
from collections import OrderedDict

from app.limits.protocol import LimiterBackend, WindowState

DEFAULT_TTL_S = 1.0
DEFAULT_MAX_TENANTS = 10_000  # entries kept; the oldest go first


class PeekCache:
    def __init__(
        self, backend: LimiterBackend, *, ttl_s: float = DEFAULT_TTL_S, max_tenants: int = DEFAULT_MAX_TENANTS
    ) -> None:
        self.backend = backend
        self._ttl = ttl_s
        self._max = max_tenants
        self._entries: OrderedDict[str, tuple[float, asyncio.Future[WindowState]]] = OrderedDict()

    @classmethod
    def reuse(cls, cache: "PeekCache | None", backend: LimiterBackend) -> "PeekCache":
        """`cache` if it reads `backend`, else a new one (the backend was swapped, as in tests)."""
        return cache if cache is not None and cache.backend is backend else cls(backend)

    async def peek(self, tenant: str) -> WindowState:
        now = time.monotonic()
        entry = self._entries.get(tenant)
        if entry is None or entry[0] <= now or _failed(entry[1]) or entry[1].get_loop() is not _loop():
            future = asyncio.ensure_future(self.backend.peek(tenant))
            future.add_done_callback(_retrieve)
            entry = (now + self._ttl, future)
            self._entries[tenant] = entry
            self._entries.move_to_end(tenant)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)
        # Shielded: one caller leaving must not cancel the read the others wait on.
        return await asyncio.shield(entry[1])


def _loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


def _failed(future: "asyncio.Future[WindowState]") -> bool:
    return future.done() and (future.cancelled() or future.exception() is not None)


def _retrieve(future: "asyncio.Future[WindowState]") -> None:
    if not future.cancelled():
        future.exception()  # marks it retrieved: callers who left do not make it a "never retrieved"
