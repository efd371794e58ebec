"""One behaviour for every LimiterBackend: local (LimiterState in-process), Ray (the actor), Redis (Lua).

The window is a fixed minute, so nothing here waits for it: window expiry is read off retry_after_ms and
reset_*_ms (computed by the backend at one instant, so their differences are exact), and lease expiry
uses short lease TTLs. LimiterState's exact behaviour over time is in test_limiter_state.py.
"""

import asyncio
import time
import uuid

import pytest
import redis
from redis.crc import key_slot

from app.limits import (
    MAX_TOKENS,
    WINDOW_MS,
    Decision,
    InvalidTokenCount,
    LimiterBackend,
    LimiterUnavailable,
    Limits,
    WindowState,
)
from app.limits.protocol import DEFAULT_MAX_WAITERS
from app.limits.redis_backend import RedisLimiter
from app.limits.state import CONCURRENCY_RETRY_MS, DELIVERING_RETRY_MS

TENANT = "acme"


def rid() -> str:
    return f"req_{uuid.uuid4().hex}"


async def admit(
    backend: LimiterBackend,
    limits: Limits,
    reserve: int = 0,
    *,
    request_id: str | None = None,
    tenant: str = TENANT,
    wait_ms: int = 0,
) -> Decision:
    return await backend.admit(tenant, request_id or rid(), limits, reserve, wait_ms=wait_ms)


async def queued_count(backend: LimiterBackend, n: int, tenant: str = TENANT) -> None:
    """Until the tenant has n waiters (waiting admits run as tasks)."""
    for _ in range(500):
        if (await backend.peek(tenant)).queued == n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never {n} waiters: {await backend.peek(tenant)}")


# --- requests per minute ----------------------------------------------------------------------------


async def test_rpm_burst_admits_exactly_rpm(backend: LimiterBackend) -> None:
    limits = Limits(rpm=50)
    decisions = await asyncio.gather(*(admit(backend, limits) for _ in range(200)))
    admitted = [d for d in decisions if d.admitted]
    denied = [d for d in decisions if not d.admitted]
    assert len(admitted) == 50 and len(denied) == 150
    # Atomic admission: each admitted request saw a different count.
    assert sorted(d.remaining_requests or 0 for d in admitted) == list(range(50))
    for d in admitted:
        assert d.reason is None and d.retry_after_ms == 0
        assert d.limit_requests == 50 and 0 < d.reset_requests_ms <= WINDOW_MS
    for d in denied:
        assert d.reason == "requests" and 0 < d.retry_after_ms <= WINDOW_MS
        assert d.limit_requests == 50 and d.remaining_requests == 0
        assert 0 < d.reset_requests_ms <= WINDOW_MS
        assert d.limit_tokens is None and d.remaining_tokens is None


async def test_rpm_retry_after_is_when_the_oldest_request_leaves(backend: LimiterBackend) -> None:
    limits = Limits(rpm=2)
    first = await admit(backend, limits)
    assert first.admitted and first.remaining_requests == 1
    assert WINDOW_MS - 1000 < first.reset_requests_ms <= WINDOW_MS
    await asyncio.sleep(0.2)
    second = await admit(backend, limits)
    assert second.admitted and second.remaining_requests == 0
    denied = await admit(backend, limits)
    assert denied.reason == "requests" and WINDOW_MS - 2000 < denied.retry_after_ms < WINDOW_MS - 190
    # One instant, two timestamps: retry_after follows the first request, reset the second.
    assert 190 <= denied.reset_requests_ms - denied.retry_after_ms < 1000
    assert set(denied.headers()) == {
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
    }
    assert denied.headers()["x-ratelimit-remaining-requests"] == "0"


# --- tokens per minute ------------------------------------------------------------------------------


async def test_token_reservations_add_up(backend: LimiterBackend) -> None:
    limits = Limits(tpm=1000)
    remaining = [(await admit(backend, limits, 300)).remaining_tokens for _ in range(3)]
    assert remaining == [700, 400, 100]
    denied = await admit(backend, limits, 300)
    assert not denied.admitted and denied.reason == "tokens"
    assert 0 < denied.retry_after_ms <= WINDOW_MS and denied.remaining_tokens == 100
    assert 0 < denied.reset_tokens_ms <= WINDOW_MS and denied.limit_tokens == 1000
    last = await admit(backend, limits, 100)
    assert last.admitted and last.remaining_tokens == 0


async def test_reservation_larger_than_tpm_is_too_large(backend: LimiterBackend) -> None:
    limits = Limits(tpm=1000)
    too_large = await admit(backend, limits, 1001)
    assert not too_large.admitted and too_large.reason == "too_large" and too_large.retry_after_ms == 0
    assert too_large.remaining_tokens == 1000
    exact = await admit(backend, limits, 1000)
    assert exact.admitted and exact.remaining_tokens == 0
    # too_large is checked first: a spent request window does not hide it.
    spent = Limits(rpm=1, tpm=1000)
    assert (await admit(backend, spent, 1001)).reason == "too_large"


async def test_release_gives_back_unused_tokens_at_once(backend: LimiterBackend) -> None:
    limits = Limits(tpm=1000)
    first = rid()
    assert (await admit(backend, limits, 1000, request_id=first)).remaining_tokens == 0
    assert (await admit(backend, limits, 990)).reason == "tokens"
    await backend.release(TENANT, first, 10)
    after = await admit(backend, limits, 990)
    assert after.admitted and after.remaining_tokens == 0
    assert (await admit(backend, limits, 1)).reason == "tokens"


async def test_release_charges_what_was_used_beyond_the_reservation(backend: LimiterBackend) -> None:
    limits = Limits(tpm=1000)
    request = rid()
    await admit(backend, limits, 100, request_id=request)
    await backend.release(TENANT, request, 400)
    probe = await admit(backend, limits, 0)
    assert probe.admitted and probe.remaining_tokens == 600


async def test_token_retry_after_counts_the_oldest_reservations_out(backend: LimiterBackend) -> None:
    limits = Limits(tpm=1000)
    await admit(backend, limits, 600)
    await asyncio.sleep(0.2)
    await admit(backend, limits, 300)
    first_out = await admit(backend, limits, 500)  # room once the 600 leaves
    both_out = await admit(backend, limits, 900)  # room once the 300 leaves too
    assert first_out.reason == both_out.reason == "tokens"
    assert WINDOW_MS - 2000 < first_out.retry_after_ms < WINDOW_MS - 190
    assert 150 <= both_out.retry_after_ms - first_out.retry_after_ms < 1000
    assert both_out.reset_tokens_ms == both_out.retry_after_ms  # the 300 is the newest reservation


# --- concurrency ------------------------------------------------------------------------------------


async def test_concurrency_slots_are_freed_by_release(backend: LimiterBackend) -> None:
    limits = Limits(max_concurrent=2)
    a, b = rid(), rid()
    assert (await admit(backend, limits, request_id=a)).admitted
    assert (await admit(backend, limits, request_id=b)).admitted
    denied = await admit(backend, limits)
    assert denied.reason == "concurrency" and denied.retry_after_ms == CONCURRENCY_RETRY_MS
    await backend.release(TENANT, a, 0)
    assert (await admit(backend, limits)).admitted
    assert (await admit(backend, limits)).reason == "concurrency"


async def test_a_delivering_lease_still_counts_but_refuses_as_delivering(backend: LimiterBackend) -> None:
    limits = Limits(max_concurrent=2)
    running, streamed = rid(), rid()
    assert (await admit(backend, limits, request_id=running)).admitted
    assert (await admit(backend, limits, request_id=streamed)).admitted
    await backend.deliver(TENANT, streamed)
    await backend.deliver(TENANT, rid())  # a lease that is not there: nothing to mark
    assert (await backend.peek(TENANT)).in_flight == 2  # still held while the proxy delivers it
    denied = await admit(backend, limits)
    assert denied.reason == "delivering" and denied.retry_after_ms == DELIVERING_RETRY_MS
    await backend.release(TENANT, streamed, 0)  # delivered: its mark goes with its lease
    third = rid()
    assert (await admit(backend, limits, request_id=third)).admitted
    assert (await admit(backend, limits)).reason == "concurrency"  # nothing there is being delivered
    await backend.deliver(TENANT, running)
    await backend.deliver(TENANT, third)
    heavy = await backend.admit(TENANT, rid(), limits, 0, sequences=2)
    assert heavy.reason == "delivering"  # both go once delivered: a weight of two fits then


async def test_a_waiter_behind_a_delivering_lease_goes_when_it_is_released(backend: LimiterBackend) -> None:
    limits = Limits(max_concurrent=1)
    streamed = rid()
    assert (await admit(backend, limits, request_id=streamed)).admitted
    await backend.deliver(TENANT, streamed)
    waiter = asyncio.create_task(admit(backend, limits, wait_ms=10_000))
    await queued_count(backend, 1)
    started = time.monotonic()
    await backend.release(TENANT, streamed, 0)
    decision = await asyncio.wait_for(waiter, 10)
    assert decision.admitted and time.monotonic() - started < 5


async def test_a_lapsed_delivering_lease_leaves_no_mark(backend: LimiterBackend) -> None:
    limits = Limits(max_concurrent=1, lease_ttl_ms=300)
    streamed = rid()
    assert (await admit(backend, limits, request_id=streamed)).admitted
    await backend.deliver(TENANT, streamed)
    await asyncio.sleep(0.35)
    held = rid()
    assert (await admit(backend, limits, request_id=held)).admitted
    await backend.deliver(TENANT, streamed)  # gone: no mark comes back
    assert (await admit(backend, limits)).reason == "concurrency"


async def test_unrenewed_lease_expires(backend: LimiterBackend) -> None:
    limits = Limits(max_concurrent=1, lease_ttl_ms=300)
    assert (await admit(backend, limits)).admitted  # never released: its ingress "crashed"
    assert (await admit(backend, limits)).reason == "concurrency"
    await asyncio.sleep(0.35)
    assert (await admit(backend, limits)).admitted


async def test_renewed_lease_outlives_its_ttl(backend: LimiterBackend) -> None:
    limits = Limits(max_concurrent=1, lease_ttl_ms=300)
    stream = rid()
    assert (await admit(backend, limits, request_id=stream)).admitted
    for _ in range(3):  # 0.45 s in all, half as long again as the TTL
        await asyncio.sleep(0.15)
        await backend.renew(TENANT, stream, limits)
    assert (await admit(backend, limits)).reason == "concurrency"
    await asyncio.sleep(0.35)  # renewals stop: the lease runs out
    assert (await admit(backend, limits)).admitted


# --- queue ------------------------------------------------------------------------------------------


async def test_queued_waiters_are_admitted_in_arrival_order(backend: LimiterBackend) -> None:
    limits = Limits(max_concurrent=1, on_limit="queue", max_queue_ms=10_000)
    holder = rid()
    assert (await admit(backend, limits, request_id=holder)).admitted
    waiters = [rid() for _ in range(5)]
    order: list[str] = []

    async def wait_turn(request_id: str) -> None:  # the backend waits; the caller makes one call
        decision = await admit(backend, limits, request_id=request_id, wait_ms=10_000)
        assert decision.admitted, decision
        order.append(request_id)
        await asyncio.sleep(0.02)
        await backend.release(TENANT, request_id, 0)

    tasks = []
    for n, waiter in enumerate(waiters, 1):
        tasks.append(asyncio.create_task(wait_turn(waiter)))
        await queued_count(backend, n)  # arrival order is the order they joined
    await asyncio.sleep(0.05)
    assert order == []
    await backend.release(TENANT, holder, 0)
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert order == waiters
    assert (await backend.peek(TENANT)).queued == 0


async def test_a_release_wakes_the_head_long_before_its_wait_ends(backend: LimiterBackend) -> None:
    limits = Limits(max_concurrent=1, on_limit="queue", max_queue_ms=30_000)
    holder = rid()
    assert (await admit(backend, limits, request_id=holder)).admitted
    waiter = asyncio.create_task(admit(backend, limits, wait_ms=30_000))
    await queued_count(backend, 1)
    await backend.release(TENANT, holder, 0)
    decision = await asyncio.wait_for(waiter, 10)
    assert decision.admitted and (await backend.peek(TENANT)).queued == 0


async def test_a_lapsed_lease_lets_the_waiter_in(backend: LimiterBackend) -> None:
    """Nobody releases (the holder's ingress crashed): the waiter's own re-checks notice the expiry."""
    limits = Limits(max_concurrent=1, lease_ttl_ms=300, on_limit="queue", max_queue_ms=5_000)
    assert (await admit(backend, limits)).admitted
    started = time.monotonic()
    decision = await admit(backend, limits, wait_ms=5_000)
    assert decision.admitted and time.monotonic() - started < 4


async def test_a_waiter_that_runs_out_of_time_leaves_the_queue(backend: LimiterBackend) -> None:
    limits = Limits(max_concurrent=1, on_limit="queue", max_queue_ms=300)
    assert (await admit(backend, limits)).admitted
    started = time.monotonic()
    decision = await admit(backend, limits, wait_ms=300)
    assert decision.reason == "concurrency" and decision.retry_after_ms > 0
    assert time.monotonic() - started >= 0.25
    assert (await backend.peek(TENANT)).queued == 0  # at once, not when its place would go stale


async def test_leave_queue_ends_the_wait_at_once(backend: LimiterBackend) -> None:
    limits = Limits(max_concurrent=1, on_limit="queue", max_queue_ms=10_000)
    holder, first, second = rid(), rid(), rid()
    assert (await admit(backend, limits, request_id=holder)).admitted
    first_wait = asyncio.create_task(admit(backend, limits, request_id=first, wait_ms=10_000))
    await queued_count(backend, 1)
    second_wait = asyncio.create_task(admit(backend, limits, request_id=second, wait_ms=10_000))
    await queued_count(backend, 2)
    await backend.leave_queue(TENANT, first)  # its caller gave up
    assert not (await asyncio.wait_for(first_wait, 5)).admitted
    await backend.release(TENANT, holder, 0)
    assert (await asyncio.wait_for(second_wait, 5)).admitted  # never behind the one that left
    assert (await backend.peek(TENANT)).queued == 0


async def test_too_large_request_never_joins_the_queue(backend: LimiterBackend) -> None:
    limits = Limits(tpm=100, max_concurrent=1, on_limit="queue", max_queue_ms=10_000)
    holder = rid()
    assert (await admit(backend, limits, request_id=holder)).admitted
    assert (await admit(backend, limits, 101, wait_ms=10_000)).reason == "too_large"
    assert (await backend.peek(TENANT)).queued == 0


async def test_waiters_past_the_cap_are_refused_at_once(backend: LimiterBackend) -> None:
    """One tenant's flood: DEFAULT_MAX_WAITERS wait, the rest get queue_full without waiting, and another
    tenant is admitted all along."""
    # Waits of 5 minutes, so that "at once" holds by a wide margin on a loaded machine (a run here took
    # 22 s for the 100 refusals on Redis beside other jobs, against a 10 s bound when waits were 20 s).
    limits = Limits(max_concurrent=1, on_limit="queue", max_queue_ms=300_000)
    holder = rid()
    assert (await admit(backend, limits, request_id=holder)).admitted
    waiting = [
        asyncio.create_task(admit(backend, limits, wait_ms=300_000)) for _ in range(DEFAULT_MAX_WAITERS)
    ]
    await queued_count(backend, DEFAULT_MAX_WAITERS)
    started = time.monotonic()
    refused = await asyncio.gather(*(admit(backend, limits, wait_ms=300_000) for _ in range(100)))
    assert time.monotonic() - started < 120  # none of them waited its 300 s
    assert {d.reason for d in refused} == {"queue_full"}
    assert all(d.retry_after_ms == CONCURRENCY_RETRY_MS for d in refused)  # the limit in the way
    other = await asyncio.gather(*(admit(backend, limits, tenant="other") for _ in range(1)))
    assert other[0].admitted
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


# --- check order, unlimited, tenants, no-ops ---------------------------------------------------------


async def test_checks_run_in_order_requests_tokens_concurrency(backend: LimiterBackend) -> None:
    assert (await admit(backend, Limits(rpm=1, tpm=100, max_concurrent=1), 100)).admitted
    assert (await admit(backend, Limits(rpm=1, tpm=100, max_concurrent=1), 100)).reason == "requests"
    assert (await admit(backend, Limits(tpm=100, max_concurrent=1), 100)).reason == "tokens"
    assert (await admit(backend, Limits(tpm=200, max_concurrent=1), 100)).reason == "concurrency"


async def test_unlimited_admits_everything(backend: LimiterBackend) -> None:
    limits = Limits()
    decisions = await asyncio.gather(*(admit(backend, limits, 10_000) for _ in range(300)))
    assert all(d.admitted and d.reason is None and d.retry_after_ms == 0 for d in decisions)
    assert all(d.limit_requests is None and d.remaining_requests is None for d in decisions)
    assert all(d.limit_tokens is None and d.remaining_tokens is None for d in decisions)
    assert decisions[0].headers() == {}


async def test_tenants_are_independent(backend: LimiterBackend) -> None:
    limits = Limits(rpm=1, tpm=100, max_concurrent=1)
    assert (await admit(backend, limits, 100, tenant="a")).admitted
    assert (await admit(backend, limits, 100, tenant="a")).reason == "requests"
    other = await admit(backend, limits, 100, tenant="b")
    assert other.admitted and other.remaining_requests == 0 and other.remaining_tokens == 0


async def test_unknown_ids_are_harmless(backend: LimiterBackend) -> None:
    limits = Limits(rpm=5, tpm=1000, max_concurrent=1)
    await backend.release("nobody", "unknown", 500)  # a tenant never seen
    await backend.renew("nobody", "unknown", limits)
    await backend.leave_queue("nobody", "unknown")
    held = rid()
    assert (await admit(backend, limits, 100, request_id=held)).admitted
    for _ in range(2):  # a known tenant, an unknown id: nothing changes, however often
        await backend.release(TENANT, "unknown", 500)
        await backend.renew(TENANT, "unknown", limits)
        await backend.leave_queue(TENANT, "unknown")
        probe = await admit(backend, limits, 0)
        assert probe.reason == "concurrency" and probe.remaining_requests == 4
        assert probe.remaining_tokens == 900
    # Releasing twice is releasing once; renewing a released lease does not bring it back.
    await backend.release(TENANT, held, 10)
    await backend.release(TENANT, held, 10)
    await backend.renew(TENANT, held, limits)
    after = await admit(backend, limits, 0)
    assert after.admitted and after.remaining_tokens == 990


async def test_rpm_zero_denies_everything(backend: LimiterBackend) -> None:
    denied = await admit(backend, Limits(rpm=0))
    assert not denied.admitted and denied.reason == "requests"
    assert 0 < denied.retry_after_ms <= WINDOW_MS and denied.remaining_requests == 0


# --- Redis only -------------------------------------------------------------------------------------


async def test_redis_unreachable_raises_limiter_unavailable_fast() -> None:
    limiter = RedisLimiter("redis://127.0.0.1:1/0", timeout_s=0.5)
    limits = Limits(rpm=1)
    try:
        calls = [
            limiter.admit(TENANT, "a", limits, 1),
            limiter.release(TENANT, "a", 1),
            limiter.renew(TENANT, "a", limits),
            limiter.leave_queue(TENANT, "a"),
        ]
        for call in calls:
            started = time.monotonic()
            with pytest.raises(LimiterUnavailable) as raised:
                await call
            assert time.monotonic() - started < 1.0
            assert isinstance(raised.value.__cause__, redis.RedisError)
    finally:
        await limiter.aclose()


async def test_redis_that_never_answers_raises_limiter_unavailable_in_time() -> None:
    """A server that accepts and then says nothing: the read timeout / deadline must end the call."""
    connections: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    limiter = RedisLimiter(f"redis://127.0.0.1:{port}/0", timeout_s=0.3)
    try:
        started = time.monotonic()
        with pytest.raises(LimiterUnavailable):
            await limiter.admit(TENANT, "a", Limits(rpm=1), 1)
        assert time.monotonic() - started < 1.0
    finally:
        await limiter.aclose()
        for writer in connections:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_redis_replicas_share_state_through_small_pools(
    redis_url: str, redis_limiter: RedisLimiter
) -> None:
    """Two ingress replicas on the same keys, each with a 2-connection pool: a burst of 200 waits for
    connections instead of opening more, and still admits exactly rpm between them."""
    replicas = [RedisLimiter(redis_url, key_prefix=redis_limiter.key_prefix, max_connections=2) for _ in "ab"]
    try:
        limits = Limits(rpm=30)
        burst = (admit(replicas[i % 2], limits) for i in range(200))
        decisions = await asyncio.gather(*burst)
        assert sum(d.admitted for d in decisions) == 30
        for replica in replicas:  # white-box: the pool never grew past its bound
            pool = replica._redis.connection_pool
            assert len(pool._available_connections) + len(pool._in_use_connections) <= 2
    finally:
        for replica in replicas:
            await replica.aclose()


async def test_redis_keys_share_a_slot_and_expire(redis_url: str, redis_limiter: RedisLimiter) -> None:
    limits = Limits(rpm=10, tpm=1000, max_concurrent=1, lease_ttl_ms=5_000)
    holder = rid()
    assert (await admit(redis_limiter, limits, 100, request_id=holder)).admitted
    waiter = asyncio.create_task(admit(redis_limiter, limits, 100, wait_ms=5_000))
    await queued_count(redis_limiter, 1)
    await redis_limiter.deliver(TENANT, holder)
    keys = redis_limiter.keys(TENANT)
    assert len({key_slot(key.encode()) for key in keys}) == 1  # one cluster slot: one script may touch all
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.exists(*keys) == len(keys)  # the queue, the window, the lease and its mark in use
        ttls = [client.pttl(key) for key in keys]
        assert all(WINDOW_MS < ttl <= WINDOW_MS + 5_000 for ttl in ttls), ttls
        assert max(ttls) - min(ttls) < 50  # one expiry: the token ZSET, hash and total vanish together
        # A renewal with a longer TTL pushes every key's expiry out; a shorter one never pulls it in.
        await redis_limiter.renew(TENANT, holder, Limits(lease_ttl_ms=600_000))
        await admit(redis_limiter, limits, 0, tenant=TENANT)
        assert all(client.pttl(key) > 600_000 for key in keys)
    finally:
        client.close()
        waiter.cancel()


async def test_redis_readmitted_id_replaces_its_reservation(redis_limiter: RedisLimiter) -> None:
    """An admit replayed for the same id (a retry after a lost reply) must not reserve twice; LimiterState
    leaks here (see test_limiter_state.test_readmitted_id_does_not_leak_tokens)."""
    limits = Limits(tpm=1000)
    assert (await admit(redis_limiter, limits, 400, request_id="dup")).remaining_tokens == 600
    assert (await admit(redis_limiter, limits, 400, request_id="dup")).remaining_tokens == 600
    await redis_limiter.release(TENANT, "dup", 100)
    assert (await admit(redis_limiter, limits, 0)).remaining_tokens == 900


async def test_redis_reloads_scripts_after_a_flush(redis_url: str, redis_limiter: RedisLimiter) -> None:
    limits = Limits(rpm=2)
    assert (await admit(redis_limiter, limits)).admitted
    client = redis.Redis.from_url(redis_url)
    try:
        client.script_flush()  # as after a failover to a replica that never saw SCRIPT LOAD
    finally:
        client.close()
    assert (await admit(redis_limiter, limits)).remaining_requests == 0


# --- bad token counts (issue 14: max_tokens=1e20 reached Redis, broke INCRBY after the script had written) --


@pytest.mark.parametrize("bad", [10**20, MAX_TOKENS + 1, -5, float("inf"), float("nan"), 0.5])
async def test_absurd_token_counts_are_refused_and_change_nothing(
    backend: LimiterBackend, bad: float
) -> None:
    limits = Limits(rpm=10)  # no tpm: no limit would have stopped the reservation
    with pytest.raises(InvalidTokenCount):
        await admit(backend, limits, bad, request_id="huge")  # type: ignore[arg-type]
    assert await backend.peek(TENANT) == WindowState(0, 0, 0, 0, 0, 0)
    held = rid()
    assert (await admit(backend, limits, 100, request_id=held)).remaining_requests == 9
    with pytest.raises(InvalidTokenCount):
        await backend.release(TENANT, held, bad)  # type: ignore[arg-type]
    state = await backend.peek(TENANT)
    assert (state.requests, state.tokens, state.in_flight) == (1, 100, 1)
    await backend.release(TENANT, held, 7)
    later = await admit(backend, limits, 5)
    assert later.admitted and later.remaining_requests == 8
    assert (await backend.peek(TENANT)).tokens == 12


async def test_redis_scripts_refuse_bad_arguments_before_writing(
    redis_url: str, redis_limiter: RedisLimiter
) -> None:
    """Past the Python checks (an older ingress, a hand-made call), each script still validates first:
    Redis does not roll back a script that fails halfway, so a late INCRBY error used to leave a counted
    request and a `1e+20` reservation behind, and every later expiry pass of the tenant failed."""
    keys = redis_limiter.keys(TENANT)
    client = redis.Redis.from_url(redis_url)
    try:
        # rpm, tpm, concurrency unlimited; reserve 1e+20 (as Python's str(1e20) sent it).
        admit_args: list[str | int] = [
            "huge",
            -1,
            -1,
            -1,
            120_000,
            "1e+20",
            0,
            WINDOW_MS,
            2_000,
            250,
            50,
            64,
            "ch",
            TENANT,
        ]
        with pytest.raises(redis.ResponseError, match="not an integer"):
            await redis_limiter._admit(keys=keys, args=admit_args)
        assert client.exists(*keys) == 0  # nothing written
        held = rid()
        assert (await admit(redis_limiter, Limits(rpm=10), 100, request_id=held)).remaining_requests == 9
        before = {key: client.dump(key) for key in keys}
        for used in ("1e+20", "nan", "-1", "2.5"):
            with pytest.raises(redis.ResponseError, match="not an integer"):
                await redis_limiter._release(keys=keys, args=[held, used, "ch", TENANT])
        assert {key: client.dump(key) for key in keys} == before
        await redis_limiter.release(TENANT, held, 10)
        assert (await redis_limiter.peek(TENANT)).tokens == 10
        assert (await admit(redis_limiter, Limits(rpm=10), 1)).remaining_requests == 8
    finally:
        client.close()
