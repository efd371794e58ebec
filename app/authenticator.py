"""Authenticator: API key -> Principal, with a short cache so most requests never touch the database.

Revocation, expiry and tenant disabling take effect within `ttl` seconds on every ingress replica.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from app.auth import hash_key, parse_prefix, verify_key
from app.errors import InvalidApiKey
from app.limits import Limits
from billing import repository
from billing.models import Tenant, Tier


@dataclass(frozen=True)
class Principal:
    tenant_id: str
    tenant_name: str
    tier: str
    key_id: str
    limits: Limits = field(default_factory=Limits)  # the tier's, with the tenant's overrides


class Authenticator:
    def __init__(self, session_factory: Callable[[], Session], server_secret: bytes, *, ttl: float) -> None:
        self._sessions = session_factory
        self._secret = server_secret
        self._ttl = ttl
        self._cache: dict[str, tuple[float, Principal]] = {}  # keyed by the key's hash, never plaintext

    async def authenticate(self, authorization: str | None) -> Principal:
        if not authorization:
            raise InvalidApiKey("You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.")
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or parse_prefix(key) is None:
            raise InvalidApiKey()
        cache_key = hash_key(self._secret, key)
        hit = self._cache.get(cache_key)
        now = time.monotonic()
        if hit is not None and hit[0] > now:
            return hit[1]
        principal = await run_in_threadpool(self._lookup, key)
        if len(self._cache) > 100_000:  # bounded: drop everything rather than track LRU on the hot path
            self._cache.clear()
        self._cache[cache_key] = (now + self._ttl, principal)
        return principal

    def _lookup(self, key: str) -> Principal:
        prefix = parse_prefix(key)
        assert prefix is not None
        with self._sessions() as session:
            found = repository.find_active_key(session, prefix=prefix, now=datetime.now(UTC))
            if found is None or not verify_key(self._secret, key, found[0].key_hash):
                raise InvalidApiKey()
            api_key, tenant = found
            tier = repository.get_tier(session, name=tenant.tier)
            return Principal(
                tenant_id=tenant.id,
                tenant_name=tenant.name,
                tier=tenant.tier,
                key_id=api_key.id,
                limits=limits_for(tier, tenant),
            )


def limits_for(tier: Tier, tenant: Tenant) -> Limits:
    """The tier's limits, each replaced by the tenant's override where one is set."""

    def pick(name: str) -> int | None:
        override: int | None = getattr(tenant, name)
        return override if override is not None else getattr(tier, name)

    return Limits(
        rpm=pick("rpm"),
        tpm=pick("tpm"),
        max_concurrent=pick("max_concurrent"),
        max_tokens_cap=pick("max_tokens_cap"),
        on_limit="queue" if tier.on_limit == "queue" else "reject",
        max_queue_ms=tier.max_queue_ms,
    )
