"""After a limiter outage: a release that failed is retried until it lands (else the lease would hold a
concurrency slot until it expires), and Redis connections that died during the outage are replaced
instead of failing one by one long after Redis is back."""

import asyncio

import pytest
import redis

from app.completions.admission import Admission
from app.limits import Decision, LimiterUnavailable, Limits
from app.limits.local_backend import LocalLimiter
from app.limits.redis_backend import RedisLimiter

LIMITS = Limits(max_concurrent=2)


class FlakyRelease(LocalLimiter):
    """The limiter is away for the first `failures` releases."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def release(self, tenant: str, request_id: str, used_tokens: int) -> None:
        if self.failures:
            self.failures -= 1
            raise LimiterUnavailable("connection refused")
        await super().release(tenant, request_id, used_tokens)


async def lease_gone(backend: LocalLimiter, within_s: float = 4.0) -> None:
    """Wait (at most `within_s`) for tenant t to hold no lease; the caller asserts that it does not."""
    for _ in range(int(within_s / 0.1)):
        if (await backend.peek("t")).in_flight == 0:
            return
        await asyncio.sleep(0.1)


async def test_a_failed_release_is_retried_until_the_lease_is_gone() -> None:
    backend = FlakyRelease(failures=2)
    admission = await Admission.acquire(
        backend, tenant="t", tier="x", request_id="r1", limits=LIMITS, reserve=10, fail_open=False
    )
    await admission.release(3)  # fails: returns at once all the same
    assert (await backend.peek("t")).in_flight == 1
    await lease_gone(backend)
    assert (await backend.peek("t")).in_flight == 0 and backend.failures == 0
    assert (await backend.peek("t")).tokens == 3  # reconciled to what was used


class AdmitsButTimesOut(FlakyRelease):
    """The admit lands over there but its answer is lost (a timeout), and the limiter stays away for the
    next `failures` releases."""

    async def admit(
        self, tenant: str, request_id: str, limits: Limits, reserve_tokens: int, *, wait_ms: int = 0,
        sequences: int = 1,
    ) -> Decision:  # fmt: skip
        await super().admit(tenant, request_id, limits, reserve_tokens, wait_ms=wait_ms, sequences=sequences)
        raise LimiterUnavailable("timed out")


async def test_a_lease_admitted_by_a_call_that_timed_out_is_given_back_once_the_limiter_is_back() -> None:
    backend = AdmitsButTimesOut(failures=2)
    with pytest.raises(LimiterUnavailable):
        await Admission.acquire(
            backend, tenant="t", tier="x", request_id="r1", limits=LIMITS, reserve=10, fail_open=False
        )
    assert (await backend.peek("t")).in_flight == 1  # the orphan, while the limiter is away
    await lease_gone(backend)
    assert (await backend.peek("t")).in_flight == 0 and backend.failures == 0


async def test_redis_connections_killed_by_an_outage_are_replaced(
    redis_limiter: RedisLimiter, redis_url: str
) -> None:
    async def admit_many(prefix: str, n: int = 25) -> list[bool]:
        results = await asyncio.gather(
            *(redis_limiter.admit("t", f"{prefix}{i}", Limits(rpm=1000), 1) for i in range(n)),
            return_exceptions=True,
        )
        return [not isinstance(r, BaseException) and r.admitted for r in results]

    assert all(await admit_many("warm"))  # the pool now holds idle connections
    # The outage, for this limiter alone: the server drops each of its connections (others' on the shared
    # server live on).
    pool = redis_limiter._redis.connection_pool
    writers = [c._writer for c in pool._available_connections if c._writer is not None]
    assert writers, "the warm-up left idle connections"
    client = redis.Redis.from_url(redis_url)
    try:
        for writer in writers:
            host, port = writer.get_extra_info("sockname")[:2]
            client.client_kill_filter(_type="normal", addr=f"{host}:{port}")
    finally:
        client.close()
    assert await admit_many("during", n=1) == [False]  # the first request meets a dead connection: a 503
    after = await admit_many("after")
    assert all(after), after  # one failure dropped every idle dead connection: no late failures


@pytest.fixture(autouse=True)
def _reset_admission_retries() -> None:
    from app import background_retry

    background_retry.RUNNING.clear()
