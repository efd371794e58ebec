"""EngineStream.stop when Serve cancels the engine stream under it (Serve cancels a cancelled HTTP
request's child calls, the engine's stream among them): the caller still gets the last output seen, to
bill, instead of losing the request's record; a caller that is itself cancelled still is."""

import asyncio
from collections.abc import AsyncGenerator

import pytest

from app.completions.engine_stream import EngineStream
from deployments.engine.interface import EngineRequest, RequestOutput, RequestUsage, SamplingParams

USAGE = RequestUsage(
    prompt_tokens=7, cached_prompt_tokens=0, completion_tokens=2, queue_ms=0.0, ttft_ms=1.0, total_ms=2.0,
    gpu_ms=1.0, preemptions=0, replica="engine-a",
)  # fmt: skip


class CancelledUnderUs:
    """An engine client whose stream Serve cancels after its acceptance and one token (as a cancelled
    parent request's child stream ends), and whose replica answers the abort; `hold` keeps it open."""

    def __init__(self, hold: bool = False) -> None:
        self.hold = hold
        self.aborts = 0

    async def generate(self, base_model: str, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        yield RequestOutput(request.request_id, "", accepted=True, usage=USAGE)
        yield RequestOutput(request.request_id, "hi", token_ids=[5, 6], usage=USAGE)
        if self.hold:
            await asyncio.Event().wait()
        raise asyncio.CancelledError

    async def abort(self, base_model: str, request_id: str, replica: str | None) -> bool:
        self.aborts += 1
        return True

    async def ready(self, base_model: str) -> bool:
        return True


def stream(client: CancelledUnderUs) -> EngineStream:
    return EngineStream(client, "base", EngineRequest("req_1", [1, 2, 3], SamplingParams(max_tokens=50)))


async def test_a_stream_cancelled_under_the_caller_still_gives_its_last_output() -> None:
    client = CancelledUnderUs()
    engine = stream(client)
    assert (await engine.next()).text == "hi"
    last = await asyncio.ensure_future(engine.stop(5.0))  # the ingress closes in a task of its own
    assert client.aborts == 1
    assert last is not None and last.usage == USAGE and last.token_ids == [5, 6]


async def test_a_caller_that_is_cancelled_itself_is_not_swallowed() -> None:
    engine = stream(CancelledUnderUs(hold=True))
    await engine.next()
    stopping = asyncio.ensure_future(engine.stop(30.0))
    await asyncio.sleep(0.05)  # it waits for the final output that never comes
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
