"""PriceCache: the prices in force for a tenant, base model and adapter, read from the price book and
kept for a few seconds, so that pricing a request costs no database round trip on the hot path.

A price change reaches new requests within the TTL; a request keeps the prices it was admitted at (its
reservation was computed from them, so its settled cost can never exceed what it reserved)."""

import time
from collections.abc import Callable

from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from billing import price_book
from billing.pricing import Prices

MAX_CACHED = 100_000


class PriceCache:
    def __init__(self, session_factory: Callable[[], Session], *, ttl_s: float) -> None:
        self._sessions = session_factory
        self._ttl = ttl_s
        self._cache: dict[tuple[str, str, str | None], tuple[float, Prices]] = {}

    async def get(self, tenant_id: str, base_model: str, adapter_id: str | None) -> Prices:
        key = (tenant_id, base_model, adapter_id)
        hit = self._cache.get(key)
        now = time.monotonic()
        if hit is not None and hit[0] > now:
            return hit[1]
        prices = await run_in_threadpool(self._read, tenant_id, base_model, adapter_id)
        if len(self._cache) >= MAX_CACHED:  # drop everything rather than track LRU: a miss is one query
            self._cache.clear()
        self._cache[key] = (now + self._ttl, prices)
        return prices

    def _read(self, tenant_id: str, base_model: str, adapter_id: str | None) -> Prices:
        with self._sessions() as session:
            return price_book.prices_at(
                session, tenant_id=tenant_id, base_model=base_model, adapter_id=adapter_id
            )
