"""Concurrency counts sequences: a request's lease weighs the sequences it runs (n x prompts), on every
backend. A request that needs more than max_concurrent is refused at once (`too_many_sequences`), never
queued, since no release could ever make room for it."""

import asyncio
import time
import uuid

import pytest

from app.limits import LimiterBackend, Limits

TENANT = "acme"


def rid() -> str:
    return f"req_{uuid.uuid4().hex}"


async def test_a_lease_weighs_its_sequences(backend: LimiterBackend) -> None:
    limits = Limits(max_concurrent=8)
    wide = rid()
    assert (await backend.admit(TENANT, wide, limits, 0, sequences=5)).admitted
    assert (await backend.admit(TENANT, rid(), limits, 0, sequences=4)).reason == "concurrency"
    assert (await backend.admit(TENANT, rid(), limits, 0, sequences=3)).admitted
    assert (await backend.peek(TENANT)).in_flight == 8
    assert (await backend.admit(TENANT, rid(), limits, 0)).reason == "concurrency"
    await backend.release(TENANT, wide, 0)
    assert (await backend.peek(TENANT)).in_flight == 3
    assert (await backend.admit(TENANT, rid(), limits, 0, sequences=5)).admitted


async def test_more_sequences_than_the_limit_are_refused_at_once(backend: LimiterBackend) -> None:
    limits = Limits(max_concurrent=4, on_limit="queue", max_queue_ms=10_000)
    started = time.monotonic()
    decision = await backend.admit(TENANT, rid(), limits, 0, wait_ms=10_000, sequences=5)
    assert decision.reason == "too_many_sequences" and not decision.admitted
    assert time.monotonic() - started < 5  # never waited for a release that cannot help
    state = await backend.peek(TENANT)
    assert state.queued == 0 and state.in_flight == 0
    assert (await backend.admit(TENANT, rid(), limits, 0, sequences=4)).admitted  # exactly the limit fits


async def test_a_wide_waiter_goes_once_enough_sequences_are_free(backend: LimiterBackend) -> None:
    limits = Limits(max_concurrent=8, on_limit="queue", max_queue_ms=10_000)
    first, second = rid(), rid()
    assert (await backend.admit(TENANT, first, limits, 0, sequences=3)).admitted
    assert (await backend.admit(TENANT, second, limits, 0, sequences=3)).admitted
    waiter = asyncio.create_task(backend.admit(TENANT, rid(), limits, 0, wait_ms=10_000, sequences=4))
    for _ in range(500):
        if (await backend.peek(TENANT)).queued == 1:
            break
        await asyncio.sleep(0.01)
    await backend.release(TENANT, first, 0)  # 3 of 8 held: 4 more fit
    decision = await asyncio.wait_for(waiter, 10)
    assert decision.admitted and (await backend.peek(TENANT)).in_flight == 7


async def test_a_lapsed_wide_lease_frees_all_its_sequences(backend: LimiterBackend) -> None:
    limits = Limits(max_concurrent=6, lease_ttl_ms=200)
    assert (await backend.admit(TENANT, rid(), limits, 0, sequences=6)).admitted
    assert (await backend.admit(TENANT, rid(), limits, 0)).reason == "concurrency"
    await asyncio.sleep(0.4)
    assert (await backend.peek(TENANT)).in_flight == 0
    assert (await backend.admit(TENANT, rid(), limits, 0, sequences=6)).admitted


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, 10**7])
async def test_bad_sequence_counts_are_refused_before_anything_changes(
    backend: LimiterBackend, bad: object
) -> None:
    with pytest.raises(ValueError, match="sequences"):
        await backend.admit(TENANT, rid(), Limits(max_concurrent=8), 0, sequences=bad)  # type: ignore[arg-type]
    state = await backend.peek(TENANT)
    assert state.requests == 0 and state.in_flight == 0
