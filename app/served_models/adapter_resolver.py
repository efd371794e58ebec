"""AdapterResolver: a request's `model` -> (base model, adapter version), per tenant, briefly cached.

The registry is the source of truth; a short TTL bounds how long a replaced or deleted adapter keeps
being served to new requests (requests already running keep the version they started with).
"""

import logging
import time
from collections.abc import Callable

from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from adapters.errors import AdapterLoadFailed, AdapterNotFound
from adapters.ref import AdapterRef
from app.auth.authenticator import Principal
from app.errors import ModelNotFound
from app.schemas.openai import ModelCard
from billing import adapter_registry

log = logging.getLogger(__name__)


class AdapterResolver:
    def __init__(self, session_factory: Callable[[], Session], *, ttl: float) -> None:
        self._sessions = session_factory
        self.ttl = ttl  # how long a name -> version answer is reused
        self._cache: dict[tuple[str, str], tuple[float, tuple[str, AdapterRef] | None]] = {}

    async def resolve(self, principal: Principal, model: str) -> tuple[str, AdapterRef] | None:
        key = (principal.tenant_id, model)
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        found = await run_in_threadpool(self._lookup, principal.tenant_id, model)
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[key] = (now + self.ttl, found)
        return found

    async def recheck(self, principal: Principal, model: str) -> tuple[str, AdapterRef] | None:
        """`resolve` from the registry itself, past the cache (an engine just failed to find the version
        the cache named); the answer replaces the cached one."""
        self._cache.pop((principal.tenant_id, model), None)
        return await self.resolve(principal, model)

    async def explain(self, principal: Principal, model: str, ref: AdapterRef, error: Exception) -> Exception:
        """An engine's `error` for a request naming `model` (adapter version `ref`), explained.
        AdapterNotFound means the engine found no stored version of the adapter: deleted since the name was
        resolved (cached for a moment), so the model is gone (404); or the registry still lists it and the
        store lost its files, which is the platform's fault (503, logged). The registry decides, afresh.
        Any other error is returned as it is."""
        if not isinstance(error, AdapterNotFound):
            return error
        try:
            gone = await self.recheck(principal, model) is None
        except Exception:  # the registry is unreachable: the platform's trouble either way
            log.exception("rechecking adapter %s in the registry failed", ref)
            gone = False
        if gone:
            return ModelNotFound(model)
        log.warning("adapter %s is registered but its engine cannot find it: %s", ref, error)
        return AdapterLoadFailed(str(ref), "the registry lists it but the store does not hold it")

    def invalidate(self) -> None:
        """Forget everything (this replica just changed the registry)."""
        self._cache.clear()

    def _lookup(self, tenant_id: str, model: str) -> tuple[str, AdapterRef] | None:
        with self._sessions() as session:
            live = adapter_registry.resolve(session, tenant_id=tenant_id, model=model)
            if live is None:
                return None
            return live.adapter.base_model, AdapterRef(live.adapter.id, live.latest.version)

    def cards(self, principal: Principal, max_model_len: Callable[[str], int | None]) -> list[ModelCard]:
        """The adapters this tenant may use, as /v1/models entries (blocking: call from a thread)."""
        with self._sessions() as session:
            cards = []
            for live in adapter_registry.visible_to(session, tenant_id=principal.tenant_id):
                base = live.adapter.base_model
                limit = max_model_len(base)
                if limit is None:  # registered for a base model this deployment does not serve
                    continue
                owner = "you" if live.adapter.owner == principal.tenant_id else "public"
                cards.append(
                    ModelCard(
                        id=live.model_name_for(principal.tenant_id),
                        created=int(live.latest.created_at.timestamp()),
                        owned_by=owner,
                        root=base,
                        parent=base,
                        max_model_len=limit,
                    )
                )
            return cards
