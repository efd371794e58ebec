"""Authenticator: API key -> Principal, with a short cache so most requests never touch the database.

Revocation, expiry and tenant disabling take effect within `ttl` seconds on every ingress replica. Keys the
database refused are cached for the same `ttl` (a negative cache), so a key created a moment after someone
tried it also works within `ttl`; a repeated bogus key costs one lookup per `ttl`, and a client whose
lookups keep failing is throttled (app/auth/failures.py: per address and key prefix) before it reaches the
database again. Concurrent requests with the same uncached key share one lookup, so a burst of one key is
one query, not one per request.
"""

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import TypeVar

from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from app.auth.api_keys import hash_key, parse_prefix, verify_key
from app.auth.failures import FailureThrottle
from app.auth.key_usage import KeyUsageRecorder
from app.errors import InvalidApiKey, TooManyFailedAuthentications
from app.limits import Limits
from billing import credit, repository
from billing.models import Tenant, Tier


@dataclass(frozen=True)
class Principal:
    tenant_id: str
    tenant_name: str
    tier: str
    key_id: str
    limits: Limits = field(default_factory=Limits)  # the tier's, with the tenant's overrides
    budgeted: bool = False  # prepaid or with a spend limit: admission reserves money (app/budgets/guard.py)
    weight: float = 1.0  # the tier's share of an engine replica against other tenants (fair admission)
    max_stored_response_bytes: int | None = None  # the tier's quota of stored responses; None: no bound
    batch_price_factor: Decimal = Decimal(1)  # a Batch API line's cost is its price times this


MAX_CACHED = 100_000
V = TypeVar("V")


class Authenticator:
    def __init__(
        self,
        session_factory: Callable[[], Session],
        server_secret: bytes,
        *,
        ttl: float,
        failures: FailureThrottle | None = None,
        key_usage: KeyUsageRecorder | None = None,
    ) -> None:
        self._sessions = session_factory
        self._secret = server_secret
        self._ttl = ttl
        self._failures = failures
        self._key_usage = key_usage
        # Both keyed by the key's hash, never plaintext.
        self._cache: dict[str, tuple[float, Principal]] = {}
        self._refused: dict[str, float] = {}  # -> until when the database's "no" stands
        self._pending: dict[str, asyncio.Future[Principal]] = {}  # lookups under way

    async def authenticate(self, authorization: str | None, client: str | None = None) -> Principal:
        """`client`: the caller's address, which failed lookups are counted against."""
        if not authorization:
            raise InvalidApiKey("You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.")
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or parse_prefix(key) is None:
            raise InvalidApiKey()  # answered from the key's shape alone: costs nothing, so not counted
        cache_key = hash_key(self._secret, key)
        now = time.monotonic()
        hit = self._cache.get(cache_key)
        if hit is not None and hit[0] > now:
            principal = hit[1]
        else:
            principal = await self._look_up(key, cache_key, client, now)
        if self._key_usage is not None:
            self._key_usage.used(principal.key_id)
        return principal

    async def _look_up(self, key: str, cache_key: str, client: str | None, now: float) -> Principal:
        if self._refused.get(cache_key, 0.0) > now:
            raise InvalidApiKey()
        pending = self._pending.get(cache_key)
        if pending is None:
            pending = self._start(key, cache_key, client, now)
        # Shielded: a caller that goes away does not cancel the lookup the others wait on.
        return await asyncio.shield(pending)

    def _start(self, key: str, cache_key: str, client: str | None, now: float) -> "asyncio.Future[Principal]":
        if client is not None and self._failures is not None:
            wait = self._failures.retry_after(client, _prefix(key), now)
            if wait is not None:
                raise TooManyFailedAuthentications(wait)
        task = asyncio.ensure_future(self._resolve(key, cache_key, client, now))
        self._pending[cache_key] = task
        task.add_done_callback(lambda done: self._settled(cache_key, done))
        return task

    def _settled(self, cache_key: str, done: "asyncio.Future[Principal]") -> None:
        if self._pending.get(cache_key) is done:
            del self._pending[cache_key]
        if not done.cancelled():
            done.exception()  # retrieved: with every caller gone, an InvalidApiKey is no "lost" error

    async def _resolve(self, key: str, cache_key: str, client: str | None, now: float) -> Principal:
        try:
            principal = await run_in_threadpool(self._lookup, key)
        except InvalidApiKey:
            _bounded(self._refused)[cache_key] = now + self._ttl
            if client is not None and self._failures is not None:
                self._failures.failed(client, _prefix(key), now)
            raise
        if self._failures is not None:
            self._failures.succeeded(_prefix(key))
        _bounded(self._cache)[cache_key] = (now + self._ttl, principal)
        return principal

    def _lookup(self, key: str) -> Principal:
        with self._sessions() as session:
            found = repository.find_active_key(session, prefix=_prefix(key), now=datetime.now(UTC))
            if found is None or not verify_key(self._secret, key, found[0].key_hash):
                raise InvalidApiKey()
            api_key, tenant = found
            return _principal(session, tenant, api_key.id)

    def principal_for(self, tenant_id: str, key_id: str) -> Principal | None:
        """The principal a tenant's key would be, without its key: a batch's lines run as the key that
        created it (None: the tenant is gone). Blocking: run it in a thread."""
        with self._sessions() as session:
            tenant = session.get(Tenant, tenant_id)
            return None if tenant is None else _principal(session, tenant, key_id)


def _principal(session: Session, tenant: Tenant, key_id: str) -> Principal:
    tier = repository.get_tier(session, name=tenant.tier)
    return Principal(
        tenant_id=tenant.id,
        tenant_name=tenant.name,
        tier=tenant.tier,
        key_id=key_id,
        limits=limits_for(tier, tenant),
        budgeted=tenant.prepaid or credit.has_spend_limits(session, tenant_id=tenant.id),
        weight=tier.weight,
        max_stored_response_bytes=tier.max_stored_response_bytes,
        batch_price_factor=Decimal(tier.batch_price_factor),
    )


def _prefix(key: str) -> str:
    prefix = parse_prefix(key)
    assert prefix is not None  # only well-formed keys get past authenticate()
    return prefix


def _bounded(cache: dict[str, V]) -> dict[str, V]:
    # Drop everything rather than track LRU on the hot path; a miss only costs one lookup.
    if len(cache) >= MAX_CACHED:
        cache.clear()
    return cache


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
