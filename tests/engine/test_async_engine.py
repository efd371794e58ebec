"""The threaded async engine: streaming, concurrency, and no orphan generation when a caller leaves."""

import asyncio
import contextlib
import time

import pytest

from deployments.engine.async_engine import AsyncEngine
from deployments.engine.config import EngineConfig
from deployments.engine.errors import EngineStopped, PromptTooLong
from deployments.engine.interface import EngineRequest, EngineStats, FinishReason, RequestOutput
from deployments.engine.sampling_params import SamplingParams
from tests.engine.helpers import drain, make_engine, running, text, tiny_config, tokens
from tests.model_fixtures import TinySetup


@pytest.fixture
def engine(llama: TinySetup):
    with running(tiny_config(llama, max_loras=4)) as engine:
        yield engine


async def collect(engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams, ref=None):
    return [out async for out in engine.generate(EngineRequest(rid, prompt, params, ref))]


async def test_streams_the_same_text_as_the_sync_engine(engine: AsyncEngine, llama: TinySetup) -> None:
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    streamed = await collect(engine, "s", [1, 2, 3, 4], params, llama.refs["demo-pirate"])
    assert len(streamed) == 20
    assert streamed[-1].finished
    assert streamed[-1].usage is not None
    assert all(not out.finished for out in streamed[:-1])

    sync = make_engine(llama)
    sync.add_request(EngineRequest("s", [1, 2, 3, 4], params, llama.refs["demo-pirate"]))
    reference = drain(sync)["s"]
    assert tokens(streamed) == tokens(reference)
    assert (
        text(streamed)
        == text(reference)
        == sync.tokenizer.decode(tokens(reference), skip_special_tokens=True)
    )
    sync.close()


async def test_concurrent_requests_over_many_adapters(engine: AsyncEngine, llama: TinySetup) -> None:
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    names = [*llama.refs, None, None]
    results = await asyncio.gather(
        *(
            collect(engine, f"r{i}", [i + 1, i + 2, i + 3], params, None if n is None else llama.refs[n])
            for i, n in enumerate(names)
        )
    )
    assert all(len(tokens(r)) == 10 and r[-1].finish_reason is FinishReason.LENGTH for r in results)
    stats = engine.stats()
    assert stats.running == 0
    assert stats.waiting == 0
    assert stats.steps > 0
    assert stats.step_seconds > stats.busy_seconds > 0  # a whole step holds its timed forward and sampling


async def test_a_whole_request_gets_each_choice_once_with_every_token_a_step_would_have_sent(
    engine: AsyncEngine, llama: TinySetup
) -> None:
    """A request answered at its end (`whole`: non-streamed, a batch line) gets its announcement and then
    one output per choice, holding the text, tokens, logprobs and prompt logprobs of every step's."""
    params = SamplingParams(
        max_tokens=12, temperature=1.0, seed=7, ignore_eos=True, n=2, logprobs=2, prompt_logprobs=1
    )
    ref = llama.refs["demo-pirate"]

    async def outputs(rid: str, whole: bool) -> list[RequestOutput]:
        request = EngineRequest(rid, [1, 2, 3, 4], params, ref, announce=True, whole=whole)
        return [out async for out in engine.generate(request)]

    steps, whole = await outputs("steps", False), await outputs("whole", True)
    assert whole[0].accepted and not whole[0].token_ids  # announced at once, as before
    answered = whole[1:]
    assert sorted(out.index for out in answered) == [0, 1] and answered[-1].finished
    assert all(out.finish_reason is FinishReason.LENGTH for out in answered)
    assert len([out for out in steps if out.token_ids]) > len(answered)  # a step's output each, before
    for out in answered:
        mine = [o for o in steps if o.index == out.index and not o.accepted]
        assert out.token_ids == tokens(mine) and out.text == text(mine) and len(out.token_ids) == 12
        assert [lp.token_id for lp in out.logprobs or []] == out.token_ids
        assert out.logprobs == [lp for o in mine for lp in o.logprobs or []]
        assert out.prompt_logprobs == next(o.prompt_logprobs for o in mine if o.prompt_logprobs is not None)
        ends = [sum(len(o.text) for o in mine[: i + 1]) for i in range(len(mine))]
        assert out.steps() == [(end, len(o.token_ids)) for end, o in zip(ends, mine, strict=True)]
    assert answered[-1].usage is not None and answered[-1].usage.completion_tokens == 24


async def test_an_aborted_whole_request_still_hands_back_what_it_generated(engine: AsyncEngine) -> None:
    request = EngineRequest("whole-abort", [1, 2, 3], LONG, announce=True, whole=True)
    stream = engine.generate(request)
    assert (await anext(stream)).accepted
    before = engine.stats().generated_tokens
    while engine.stats().generated_tokens < before + 5:  # it is decoding
        await asyncio.sleep(0.002)
    assert await engine.abort("whole-abort")
    rest = [out async for out in stream]
    assert len(rest) == 1 and rest[0].finish_reason is FinishReason.ABORT and rest[0].finished
    assert rest[0].usage is not None and len(rest[0].token_ids) == rest[0].usage.completion_tokens >= 5


LONG = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)  # seconds of work on the tiny model
FREED_WITHIN_S = 2.0


async def freed_after(engine: AsyncEngine, before: EngineStats) -> tuple[EngineStats, float]:
    """Waits until the engine holds nothing (no sequence, no KV block); returns its stats and how long
    that took. Fails if it takes longer than FREED_WITHIN_S."""
    start = time.monotonic()
    while True:
        stats = engine.stats()
        if stats.running == stats.waiting == 0 and stats.kv_usage == 0.0 and stats.steps > before.steps:
            return stats, time.monotonic() - start
        assert time.monotonic() - start < FREED_WITHIN_S, f"still holding work: {stats}"
        await asyncio.sleep(0.002)


def assert_aborted_early(before: EngineStats, after: EngineStats, *, received: int) -> None:
    """The engine aborted the request (it did not simply finish first) after a handful of tokens."""
    assert after.aborts == before.aborts + 1
    generated = after.generated_tokens - before.generated_tokens
    assert received <= generated < LONG.max_tokens // 4  # type: ignore[operator]


async def test_leaving_the_stream_aborts_the_request(engine: AsyncEngine) -> None:
    before = engine.stats()
    received = []
    async with contextlib.aclosing(engine.generate(EngineRequest("gone", [1, 2, 3], LONG))) as stream:
        async for out in stream:
            received.append(out)
            if len(received) == 3:
                break  # the client disconnected
    assert all(out.token_ids and not out.finished for out in received)
    after, _ = await freed_after(engine, before)
    assert_aborted_early(before, after, received=3)


async def test_cancelled_task_aborts_too(engine: AsyncEngine) -> None:
    before = engine.stats()
    task = asyncio.create_task(collect(engine, "cancel-me", [1, 2, 3], LONG))
    while engine.stats().generated_tokens < before.generated_tokens + 5:  # it is decoding
        await asyncio.sleep(0.002)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    after, _ = await freed_after(engine, before)
    assert_aborted_early(before, after, received=5)


async def test_bad_input_raises_before_anything_is_queued(engine: AsyncEngine) -> None:
    with pytest.raises(PromptTooLong):
        await collect(engine, "big", [1] * 5000, SamplingParams(max_tokens=5))
    assert engine.stats().waiting == 0


async def test_shut_down_engine_refuses_work(llama: TinySetup) -> None:
    config = EngineConfig(model=llama.model_dir, adapter_store=llama.store_root, num_kv_blocks=64)
    engine = AsyncEngine(config)
    engine.shutdown()
    with pytest.raises(EngineStopped):
        await collect(engine, "late", [1, 2], SamplingParams(max_tokens=2))
