"""A whole engine step that fails (the forward pass raises) fails the requests in that step, frees what
they held, and the engine serves the next request as if nothing happened. The requests end with a named
error that says nothing of the cause; the cause is logged with their ids."""

import logging

import pytest

from deployments.engine.interface import EngineRequest, FinishReason, RequestFailed, SamplingParams
from tests.engine.helpers import drain, make_engine, preload, tokens
from tests.model_fixtures import TinySetup

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_a_failed_forward_pass_fails_its_step_and_the_engine_goes_on(
    llama: TinySetup, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(llama)
    preload(engine, llama)  # both requests are scheduled in the first step
    expected = tokens(_run_alone(llama, "later"))
    run = engine.runner.run

    def broken_once(scheduled: object) -> object:
        monkeypatch.setattr(engine.runner, "run", run)  # only this step breaks
        raise RuntimeError("device fell over")

    monkeypatch.setattr(engine.runner, "run", broken_once)
    engine.add_request(EngineRequest("a", [1, 2, 3], GREEDY))
    engine.add_request(EngineRequest("b", [4, 5, 6], GREEDY, llama.refs["demo-sql"]))
    with caplog.at_level(logging.ERROR, logger="deployments.engine.llm_engine"):
        outputs = {out.request_id: out for out in engine.step()}
    assert set(outputs) == {"a", "b"}
    for out in outputs.values():
        assert out.finished and out.finish_reason is FinishReason.ERROR
        assert isinstance(out.error, RequestFailed) and "device fell over" not in str(out.error)
    [logged] = [r for r in caplog.records if r.exc_info]
    assert "a, b" in logged.getMessage() and "device fell over" in (logged.exc_text or "")
    stats = engine.stats()
    assert stats.running == stats.waiting == 0 and stats.kv_usage == 0.0
    assert stats.free_slots == engine.adapters.slots.num_slots  # every adapter page free or idle

    engine.add_request(EngineRequest("later", [7, 8, 9], GREEDY))
    assert tokens(drain(engine)["later"]) == expected


def _run_alone(llama: TinySetup, rid: str) -> list:  # type: ignore[type-arg]
    engine = make_engine(llama)
    engine.add_request(EngineRequest(rid, [7, 8, 9], GREEDY))
    outputs = drain(engine)[rid]
    engine.close()
    return outputs
