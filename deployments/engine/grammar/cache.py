"""GrammarCache: compiled grammars and refusals by tenant and spec, a bounded share per tenant.

One LRU per tenant, each at most `share` entries, all together at most `size`. A tenant's new entry past
its share evicts its own least recently used one; past `size`, the tenant holding the most entries gives
one up. So a tenant cycling schemas only ever churns its own share: another tenant's grammars stay (as
long as it holds no more than the cycler), and its requests keep hitting them.

Entries are never shared across tenants, even for equal specs: a hit is visible in the time to first
token, so a shared cache would tell a tenant which schemas another one sends (the prefix cache is salted
per tenant for the same reason). An entry may expire (`ttl_s`): a refusal that load could have caused is
retried after a while, not kept for good. Thread-safe.
"""

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")
Tenant = str | None


@dataclass(slots=True)
class _Entry(Generic[V]):
    value: V
    expires: float | None  # on the cache's clock; None: never
    used: int  # the cache's tick at its last use: ties between the largest holders go to the staler one


class GrammarCache(Generic[V]):
    def __init__(self, size: int, share: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not 1 <= share <= size:
            raise ValueError(f"the tenant share must be in [1, size={size}], got {share}")
        self.size = size
        self.share = share
        self._clock = clock
        self._tenants: dict[Tenant, OrderedDict[Hashable, _Entry[V]]] = {}
        self._len = 0
        self._tick = 0
        self._lock = threading.Lock()

    def get(self, tenant: Tenant, key: Hashable) -> V | None:
        """The tenant's live entry for `key` (now its most recently used), or None."""
        with self._lock:
            entries = self._tenants.get(tenant)
            entry = entries.get(key) if entries is not None else None
            if entries is None or entry is None:
                return None
            if entry.expires is not None and self._clock() >= entry.expires:
                self._drop(tenant, key)
                return None
            entries.move_to_end(key)
            entry.used = self._next_tick()
            return entry.value

    def put(self, tenant: Tenant, key: Hashable, value: V, *, ttl_s: float | None = None) -> V:
        """Store `value` unless the tenant already holds a live entry for `key`; returns the entry kept
        (the first stored wins: two threads that built the same spec agree on one grammar, and a refusal
        stays until it expires even if a late compile of the spec finishes meanwhile)."""
        with self._lock:
            entries = self._tenants.setdefault(tenant, OrderedDict())
            entry = entries.get(key)
            if entry is not None and (entry.expires is None or self._clock() < entry.expires):
                entries.move_to_end(key)
                entry.used = self._next_tick()
                return entry.value
            if entry is not None:
                self._drop(tenant, key)
                entries = self._tenants.setdefault(tenant, OrderedDict())
            expires = None if ttl_s is None else self._clock() + ttl_s
            entries[key] = _Entry(value, expires, self._next_tick())
            self._len += 1
            if len(entries) > self.share:
                self._drop(tenant, next(iter(entries)))
            while self._len > self.size:
                self._evict_one()
            return value

    def __len__(self) -> int:
        with self._lock:
            return self._len

    def held_by(self, tenant: Tenant) -> int:
        with self._lock:
            return len(self._tenants.get(tenant, ()))

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _evict_one(self) -> None:
        """The least recently used entry of the tenant holding the most (of those, the stalest)."""

        def rank(tenant: Tenant) -> tuple[int, int]:
            entries = self._tenants[tenant]
            return len(entries), -next(iter(entries.values())).used

        victim = max(self._tenants, key=rank)
        self._drop(victim, next(iter(self._tenants[victim])))

    def _drop(self, tenant: Tenant, key: Hashable) -> None:
        entries = self._tenants[tenant]
        del entries[key]
        self._len -= 1
        if not entries:
            del self._tenants[tenant]
