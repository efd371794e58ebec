"""A request's GPU-time bound (EngineRequest.max_gpu_ms): the engine ends the request after the step that
reaches it, as finish_reason LENGTH with gpu_limited, and charges at most the bound: the crossing step's
excess (at most that step's share) is measured but not charged, so a budget hold of bound x price holds."""

import pytest

from deployments.engine.interface import EngineRequest, FinishReason, InvalidRequest, SamplingParams
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.outputs import RequestOutput
from tests.engine.helpers import drain, make_engine
from tests.model_fixtures import TinySetup


def _run_stepwise(
    engine: LLMEngine, request_id: str, bound: float
) -> tuple[list[RequestOutput], float, float]:
    """Step until `request_id` ends; checks it ran on only while under its bound. Returns its outputs and
    its measured GPU time before and after its last step (ms)."""
    outputs: list[RequestOutput] = []
    group = engine.group(request_id)
    before = after = 0.0
    while not outputs or not outputs[-1].finished:
        assert after < bound  # it was stepped again only while under its bound
        before = after
        outputs += [out for out in engine.step() if out.request_id == request_id]
        after = sum(seq.metrics.gpu_time for seq in group) * 1e3
    return outputs, before, after


def test_a_tiny_bound_stops_the_request_after_its_first_step(llama: TinySetup) -> None:
    engine = make_engine(llama)
    bound = 0.001  # 1 us: any step of a model passes it
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, n=2)
    engine.add_request(EngineRequest("bounded", [1, 2, 3], params, max_gpu_ms=bound))
    engine.add_request(EngineRequest("free", [4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True)))
    busy = engine.counters.busy_seconds
    group = engine.group("bounded")

    outputs = [out for out in engine.step() if out.request_id == "bounded"]

    step_ms = (engine.counters.busy_seconds - busy) * 1e3
    measured = sum(seq.metrics.gpu_time for seq in group) * 1e3
    assert bound <= measured <= bound + step_ms  # over by at most the step that crossed it
    finals = [out for out in outputs if out.finish_reason is not None]
    assert sorted(out.index for out in finals) == [0, 1]  # the waiting choice ends too
    assert all(out.finish_reason is FinishReason.LENGTH and out.gpu_limited for out in finals)
    last = outputs[-1]
    assert last.finished and last.usage is not None
    assert last.usage.gpu_ms == bound  # charged the bound, not the measured excess
    assert last.usage.completion_tokens == 1  # the leader's first token; its follower had not begun

    rest = drain(engine)["free"]  # a request without a bound beside it runs to its max_tokens
    assert rest[-1].finish_reason is FinishReason.LENGTH and not rest[-1].gpu_limited
    assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == 8


def test_the_request_stops_at_the_step_that_reaches_its_bound(llama: TinySetup) -> None:
    engine = make_engine(llama)
    engine.add_request(EngineRequest("probe", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
    probe = drain(engine)["probe"][-1].usage
    assert probe is not None and probe.gpu_ms > 0
    bound = probe.gpu_ms * 3  # about a dozen steps' worth
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest("bounded", [1, 2, 3], params, max_gpu_ms=bound))

    outputs, before, after = _run_stepwise(engine, "bounded", bound)

    last = outputs[-1]
    assert last.usage is not None
    if last.gpu_limited:  # it stopped at the bound (400 tokens take far more: see the probe)
        assert before < bound <= after  # stopped at the first step that reached it, not later
        assert last.finish_reason is FinishReason.LENGTH and last.usage.completion_tokens < 400
        assert last.usage.gpu_ms == bound
    else:
        assert last.usage.completion_tokens == 400 and after < bound
    assert last.usage.gpu_ms <= bound


def test_a_generous_bound_changes_nothing(llama: TinySetup) -> None:
    engine = make_engine(llama)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest("r", [1, 2, 3], params, max_gpu_ms=1e9))
    group = engine.group("r")
    last = drain(engine)["r"][-1]
    assert last.finish_reason is FinishReason.LENGTH and not last.gpu_limited
    assert last.usage is not None and last.usage.completion_tokens == 6
    assert last.usage.gpu_ms == pytest.approx(sum(s.metrics.gpu_time for s in group) * 1e3, rel=1e-12)


@pytest.mark.parametrize("bound", [0.0, -1.0, float("nan")])
def test_a_bound_must_be_positive(llama: TinySetup, bound: float) -> None:
    engine = make_engine(llama)
    with pytest.raises(InvalidRequest):
        engine.add_request(EngineRequest("r", [1, 2], SamplingParams(max_tokens=2), max_gpu_ms=bound))
