"""`peek` on every LimiterBackend (local, Ray, Redis): it reports what the window holds, and reading it,
however often, never changes what admission decides next."""

import asyncio
import uuid

import redis

from app.limits import WINDOW_MS, LimiterBackend, LimiterUnavailable, Limits, WindowState
from app.limits.local_backend import LocalLimiter
from app.limits.peek_cache import PeekCache
from app.limits.redis_backend import RedisLimiter
from app.limits.state import LimiterState

TENANT = "acme"
EMPTY = WindowState(requests=0, tokens=0, in_flight=0, queued=0, reset_requests_ms=0, reset_tokens_ms=0)


def rid() -> str:
    return f"req_{uuid.uuid4().hex}"


async def test_unknown_tenant_is_empty(backend: LimiterBackend) -> None:
    assert await backend.peek("nobody") == EMPTY


async def test_peek_counts_requests_tokens_and_leases(backend: LimiterBackend) -> None:
    limits = Limits(rpm=10, tpm=1000, max_concurrent=3)
    first, second = rid(), rid()
    await backend.admit(TENANT, first, limits, 300)
    await asyncio.sleep(0.05)
    decision = await backend.admit(TENANT, second, limits, 200)
    state = await backend.peek(TENANT)
    assert (state.requests, state.tokens, state.in_flight, state.queued) == (2, 500, 2, 0)
    assert state.remaining_requests(limits) == 8 == decision.remaining_requests
    assert state.remaining_tokens(limits) == 500 == decision.remaining_tokens
    # Read a moment after the admission: its reset times can only have come closer, by little.
    assert 0 <= decision.reset_requests_ms - state.reset_requests_ms < 1000
    assert 0 <= decision.reset_tokens_ms - state.reset_tokens_ms < 1000
    await backend.release(TENANT, first, 10)  # reconciled to what it used, lease freed
    state = await backend.peek(TENANT)
    assert (state.requests, state.tokens, state.in_flight) == (2, 210, 1)
    assert state.remaining_requests(Limits()) is None and state.remaining_tokens(Limits()) is None


async def test_peeking_consumes_nothing(backend: LimiterBackend) -> None:
    limits = Limits(rpm=3, tpm=100, max_concurrent=2)
    await backend.admit(TENANT, rid(), limits, 40)
    before = await backend.peek(TENANT)
    for _ in range(50):
        assert (await backend.peek(TENANT)).requests == before.requests
    decision = await backend.admit(TENANT, rid(), limits, 60)
    assert decision.admitted and decision.remaining_requests == 1 and decision.remaining_tokens == 0
    after = await backend.peek(TENANT)
    assert (after.requests, after.tokens, after.in_flight) == (2, 100, 2)


async def test_peek_counts_queued_waiters_without_holding_their_place(backend: LimiterBackend) -> None:
    limits = Limits(max_concurrent=1, on_limit="queue", max_queue_ms=10_000)
    holder, waiter = rid(), rid()
    assert (await backend.admit(TENANT, holder, limits, 0, wait_ms=10_000)).admitted
    waiting = asyncio.create_task(backend.admit(TENANT, waiter, limits, 0, wait_ms=10_000))
    for _ in range(500):
        if (await backend.peek(TENANT)).queued == 1:
            break
        await asyncio.sleep(0.01)
    assert (await backend.peek(TENANT)).queued == 1
    await backend.leave_queue(TENANT, waiter)
    assert (await asyncio.wait_for(waiting, 5)).reason == "concurrency"
    state = await backend.peek(TENANT)
    assert (state.queued, state.in_flight) == (0, 1)


async def test_expired_leases_are_not_counted(backend: LimiterBackend) -> None:
    limits = Limits(max_concurrent=1, lease_ttl_ms=200)
    assert (await backend.admit(TENANT, rid(), limits, 0)).admitted
    assert (await backend.peek(TENANT)).in_flight == 1
    await asyncio.sleep(0.25)
    assert (await backend.peek(TENANT)).in_flight == 0
    assert (await backend.admit(TENANT, rid(), limits, 0)).admitted


def test_state_peek_ignores_what_left_the_window_without_expiring_it() -> None:
    """The window itself, on LimiterState's explicit clock (the backends' minute is too long to wait for)."""
    state = LimiterState()
    limits = Limits(rpm=5, tpm=1000, max_concurrent=3, lease_ttl_ms=WINDOW_MS * 2)
    state.admit(TENANT, "old", limits, 300, queued=False, now=0)
    state.admit(TENANT, "new", limits, 200, queued=False, now=WINDOW_MS // 2)
    mid = state.peek(TENANT, now=WINDOW_MS // 2 + 1)
    assert (mid.requests, mid.tokens, mid.reset_requests_ms) == (2, 500, WINDOW_MS - 1)
    later = state.peek(TENANT, now=WINDOW_MS)  # "old" is exactly a window old: out, as _expire has it
    assert (later.requests, later.tokens, later.in_flight) == (1, 200, 2)
    assert later.reset_requests_ms == later.reset_tokens_ms == WINDOW_MS // 2
    gone = state.peek(TENANT, now=WINDOW_MS * 2)  # "old"'s lease has run out too, "new"'s has not
    assert (gone.requests, gone.tokens, gone.in_flight, gone.reset_requests_ms) == (0, 0, 1, 0)
    # Nothing was expired by reading: the next admission still does that itself.
    decision = state.admit(TENANT, "next", limits, 0, queued=False, now=WINDOW_MS)
    assert decision.remaining_requests == 3 and decision.remaining_tokens == 800


async def test_redis_peek_writes_nothing(redis_url: str, redis_limiter: RedisLimiter) -> None:
    keys = redis_limiter.keys(TENANT)
    client = redis.Redis.from_url(redis_url)
    try:
        await redis_limiter.peek(TENANT)
        assert client.exists(*keys) == 0  # an unknown tenant: no key created
        limits = Limits(rpm=5, tpm=1000, max_concurrent=2, lease_ttl_ms=5_000)
        await redis_limiter.admit(TENANT, rid(), limits, 100)
        dumps = [client.dump(key) for key in keys]
        live = [key for key in keys if client.exists(key)]  # no queue: its two keys do not exist
        ttls = [client.pttl(key) for key in live]
        await asyncio.sleep(0.05)
        for _ in range(5):
            await redis_limiter.peek(TENANT)
        assert [client.dump(key) for key in keys] == dumps
        # Expiry not pushed back either: the keys keep ageing as if nobody had looked.
        assert len(live) == 6 and all(0 < client.pttl(k) < ttl for k, ttl in zip(live, ttls, strict=True))
    finally:
        client.close()


# --- PeekCache: what /v1/limits and /readyz read through ---------------------------------------------


class CountingPeeks(LocalLimiter):
    def __init__(self, failures: int = 0) -> None:
        super().__init__()
        self.peeks = 0
        self.failures = failures

    async def peek(self, tenant: str) -> WindowState:
        self.peeks += 1
        await asyncio.sleep(0.01)  # a round trip, so concurrent readers overlap
        if self.failures:
            self.failures -= 1
            raise LimiterUnavailable("connection refused")
        return await super().peek(tenant)


async def test_peek_cache_makes_one_read_per_tenant_per_ttl() -> None:
    # A TTL a loaded 2-core machine cannot outrun with these 222 peeks (0.3 s once expired mid-test in CI).
    backend = CountingPeeks()
    cache = PeekCache(backend, ttl_s=2.0)
    await backend.admit(TENANT, rid(), Limits(rpm=5), 10)
    states = await asyncio.gather(*(cache.peek(TENANT) for _ in range(200)))
    assert backend.peeks == 1 and {s.requests for s in states} == {1}
    for _ in range(20):
        await cache.peek(TENANT)
    await cache.peek("other")  # per tenant
    assert backend.peeks == 2
    await asyncio.sleep(2.05)
    assert (await cache.peek(TENANT)).requests == 1 and backend.peeks == 3


async def test_peek_cache_never_keeps_a_failure() -> None:
    backend = CountingPeeks(failures=1)
    cache = PeekCache(backend, ttl_s=60)
    failed = await asyncio.gather(*(cache.peek(TENANT) for _ in range(5)), return_exceptions=True)
    assert all(isinstance(f, LimiterUnavailable) for f in failed) and backend.peeks == 1
    assert await cache.peek(TENANT) == EMPTY and backend.peeks == 2
    assert PeekCache.reuse(cache, backend) is cache and PeekCache.reuse(cache, LocalLimiter()) is not cache
