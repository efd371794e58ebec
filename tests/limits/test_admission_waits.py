"""Admission against each backend when a tenant floods a queue tier (issue 14): the backend does the waiting
(one admit call per request, no polling loop), at most DEFAULT_MAX_WAITERS of one tenant wait while the
rest are refused at once, and another tenant is admitted all along, never told the limiter is away."""

import asyncio
import dataclasses
import time
import uuid
from collections import Counter

import pytest

from app.completions.admission import Admission
from app.errors import RateLimited, TooManySequences
from app.limits import Decision, LimiterBackend, LimiterUnavailable, Limits, WindowState
from app.limits.local_backend import LocalLimiter
from app.limits.protocol import DEFAULT_MAX_WAITERS, DELIVERY_GRACE_MS

QUEUE = Limits(max_concurrent=1, on_limit="queue", max_queue_ms=2_500)
ORDINARY = Limits(rpm=100_000, max_concurrent=1_000)
FLOOD = 400


class Recording:
    """A backend that counts its admit calls and notes every answer's reason."""

    def __init__(self, backend: LimiterBackend) -> None:
        self.backend = backend
        self.admits = 0
        self.reasons: Counter[str | None] = Counter()

    async def admit(
        self,
        tenant: str,
        request_id: str,
        limits: Limits,
        reserve_tokens: int,
        *,
        wait_ms: int = 0,
        sequences: int = 1,
    ) -> Decision:
        self.admits += 1
        decision = await self.backend.admit(
            tenant, request_id, limits, reserve_tokens, wait_ms=wait_ms, sequences=sequences
        )
        self.reasons[decision.reason] += 1
        return decision

    async def release(self, tenant: str, request_id: str, used_tokens: int) -> None:
        await self.backend.release(tenant, request_id, used_tokens)

    async def renew(self, tenant: str, request_id: str, limits: Limits) -> None:
        await self.backend.renew(tenant, request_id, limits)

    async def deliver(self, tenant: str, request_id: str) -> None:
        await self.backend.deliver(tenant, request_id)

    async def leave_queue(self, tenant: str, request_id: str) -> None:
        await self.backend.leave_queue(tenant, request_id)

    async def peek(self, tenant: str) -> WindowState:
        return await self.backend.peek(tenant)


async def acquire(backend: LimiterBackend, tenant: str, limits: Limits) -> Admission:
    return await Admission.acquire(
        backend, tenant=tenant, tier="t", request_id=f"r-{uuid.uuid4().hex}", limits=limits, reserve=1,
        fail_open=False,
    )  # fmt: skip


async def test_a_queued_request_is_one_admit_call() -> None:
    backend = Recording(LocalLimiter())
    holder = await acquire(backend, "a", QUEUE)
    waiter = asyncio.create_task(acquire(backend, "a", QUEUE))
    await asyncio.sleep(0.6)  # the old caller polled every 25 ms: some 24 calls by now
    await holder.release(1)
    admitted = await asyncio.wait_for(waiter, 5)
    assert admitted.decision is not None and admitted.decision.admitted
    assert backend.admits == 2  # the holder's, and the waiter's one call
    started = time.monotonic()
    with pytest.raises(RateLimited):  # nobody releases: out of time after max_queue_ms, still one call
        await acquire(backend, "a", QUEUE)
    assert time.monotonic() - started >= QUEUE.max_queue_ms / 1000 - 0.1
    assert backend.admits == 3


async def test_a_flooding_tenant_cannot_crowd_out_another(backend: LimiterBackend) -> None:
    recording = Recording(backend)
    # The waiters' wait outlasts the flood's arrival (seconds on a busy machine, through the Ray actor): a
    # waiter that ran out of time meanwhile would give its place to a later arrival, not refused then.
    queue = dataclasses.replace(QUEUE, max_queue_ms=8_000)
    await acquire(recording, "flood", queue)  # holds the flooding tenant's one slot for good

    async def flood() -> list[BaseException | Admission]:
        return await asyncio.gather(*(acquire(recording, "flood", queue) for _ in range(FLOOD)),
                                    return_exceptions=True)  # fmt: skip

    async def ordinary() -> list[Admission]:
        admitted = []
        for _ in range(40):
            admission = await acquire(recording, "quiet", ORDINARY)
            await admission.release(1)
            admitted.append(admission)
            await asyncio.sleep(0.01)
        return admitted

    flooded, quiet = await asyncio.gather(flood(), ordinary())
    assert all(a.decision is not None and a.decision.admitted for a in quiet)  # no 503, no 429
    assert all(isinstance(outcome, RateLimited) for outcome in flooded), Counter(map(type, flooded))
    # Past the cap the flood is refused at once; the waiters run out of time behind the held slot.
    assert recording.reasons["queue_full"] == FLOOD - DEFAULT_MAX_WAITERS
    assert recording.reasons["concurrency"] + recording.reasons["queued"] == DEFAULT_MAX_WAITERS
    assert recording.admits == 1 + FLOOD + 40  # one call per request: nobody polled
    assert (await backend.peek("flood")).queued == 0


async def test_an_unreachable_limiter_is_still_a_503_for_waiters() -> None:
    class Down(LocalLimiter):
        async def admit(self, *args: object, **kwargs: object) -> Decision:
            raise LimiterUnavailable("connection refused")

    with pytest.raises(LimiterUnavailable):
        await acquire(Down(), "a", QUEUE)


async def test_a_request_wider_than_its_tier_is_refused_without_waiting(backend: LimiterBackend) -> None:
    """On a queue tier, 5 sequences against a concurrency of 4 never wait: a 400 at once, one admit call."""
    recording = Recording(backend)
    started = time.monotonic()
    with pytest.raises(TooManySequences) as refused:
        await Admission.acquire(
            recording, tenant="wide", tier="t", request_id="r-wide", reserve=1, fail_open=False,
            limits=Limits(max_concurrent=4, on_limit="queue", max_queue_ms=20_000), sequences=5,
        )  # fmt: skip
    assert time.monotonic() - started < 5 and recording.admits == 1
    assert refused.value.status == 400 and "5 sequences" in refused.value.message
    assert "tier t runs at most 4 sequences at once" in refused.value.message
    assert (await backend.peek("wide")).queued == 0


REJECT_ONE = Limits(max_concurrent=1)


async def test_a_reject_tier_waits_briefly_only_for_a_stream_being_delivered(backend: LimiterBackend) -> None:
    """A client that read its stream to the end and sends the next request at once is not refused for
    the lease the proxy's acknowledgement has not freed yet; a request kept out by a running one is
    refused at once, and one kept out by a stream nobody reads after the grace, for concurrency."""
    recording = Recording(backend)
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    running = await acquire(recording, tenant, REJECT_ONE)
    started = time.monotonic()
    with pytest.raises(RateLimited) as refused:
        await acquire(recording, tenant, REJECT_ONE)
    assert "concurrent sequences" in refused.value.message and recording.admits == 2
    assert time.monotonic() - started < DELIVERY_GRACE_MS / 1000

    await running.delivering()
    later = asyncio.create_task(acquire(recording, tenant, REJECT_ONE))
    await asyncio.sleep(0.2)
    assert not later.done()  # waiting for the delivery's end, not refused
    await running.release(1)
    admitted = await asyncio.wait_for(later, 5)
    assert recording.reasons["delivering"] == 1

    await admitted.delivering()  # never acknowledged: the next request is refused after the grace
    started = time.monotonic()
    with pytest.raises(RateLimited) as refused:
        await acquire(recording, tenant, REJECT_ONE)
    assert "concurrent sequences" in refused.value.message
    assert time.monotonic() - started >= DELIVERY_GRACE_MS / 1000 - 0.1
    assert (await backend.peek(tenant)).queued == 0
    await admitted.release(1)
