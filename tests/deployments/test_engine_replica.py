"""The engine deployment's own checks: when the engine loop dies, streams end with EngineStopped,
`ready` turns false and Serve's health check (`check_health`) raises, so Serve restarts the replica."""

from collections.abc import Iterator

import pytest

from deployments.engine.interface import EngineRequest, EngineStopped, SamplingParams
from deployments.engine_replica import EngineReplica
from tests.model_fixtures import TinySetup


@pytest.fixture
def replica(llama: TinySetup) -> Iterator[EngineReplica]:
    config = {"model": str(llama.model_dir), "adapter_store": str(llama.store_root), "num_kv_blocks": 64}
    replica = EngineReplica(config, watch_registry=False, metrics_interval_s=0.1)
    yield replica
    replica.__del__()


async def test_a_dead_engine_loop_fails_streams_and_the_health_check(
    replica: EngineReplica, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = SamplingParams(max_tokens=3, temperature=0)
    outputs = [out async for out in replica.generate(EngineRequest("fine", [1, 2, 3], params))]
    assert outputs[-1].finished
    replica.check_health()
    assert replica.ready()

    def dies() -> None:
        raise MemoryError("the loop thread's step blew up")

    monkeypatch.setattr(replica.engine._engine, "step", dies)
    with pytest.raises(EngineStopped, match="blew up"):
        async for _ in replica.generate(EngineRequest("doomed", [4, 5, 6], params)):
            pass
    assert not replica.ready()
    with pytest.raises(EngineStopped, match="engine loop died"):
        replica.check_health()
    with pytest.raises(EngineStopped):  # and it refuses new work instead of queueing it forever
        async for _ in replica.generate(EngineRequest("after", [1], params)):
            pass
