"""The engine request's priority class: "batch" sequences take only rows no "interactive" sequence wants.
They are admitted after every waiting interactive one, a waiting interactive one preempts the newest running
batch one at once (it resumes from the prefix cache, its output unchanged), and the class comes before the
fair order and FIFO. Driven through the real engine on the tiny model."""

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from deployments.engine.interface import EngineRequest, SamplingParams
from deployments.engine.llm_engine import LLMEngine
from tests.engine.helpers import drain, make_engine, preload
from tests.model_fixtures import TinySetup

_first = iter(range(11, 10_000, 37))


def _request(rid: str, tenant: str, priority: str, max_tokens: int = 6) -> EngineRequest:
    first = next(_first) % 900 + 10  # distinct prompts: no prefix-cache hits between requests
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    prompt = [first, *((first + k) % 1000 + 1 for k in range(1, 8))]
    return EngineRequest(rid, prompt, params, cache_salt=tenant, tenant=tenant, priority=priority)  # type: ignore[arg-type]


def _tokens(outputs: list[Any]) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


def _stepping(
    engine: LLMEngine, requests: list[EngineRequest]
) -> tuple[dict[str, list[Any]], Callable[[], None]]:
    """Add `requests`; the outputs by request id, and a step that collects into them."""
    for r in requests:
        engine.add_request(r)
    outputs: dict[str, list[Any]] = {}

    def step() -> None:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)

    return outputs, step


def _admitted(engine: LLMEngine) -> list[str]:
    return sorted(s.group_id for s in engine.scheduler.running)


@pytest.mark.parametrize("scheduling", ["fair", "fifo"])
def test_waiting_interactive_sequences_are_admitted_before_batch_ones(
    llama: TinySetup, scheduling: str
) -> None:
    engine = make_engine(llama, max_num_seqs=2, scheduling=scheduling)
    for i in range(3):  # the batch requests arrive first, from the least served tenant too
        engine.add_request(_request(f"b{i}", "offline", "batch"))
    engine.add_request(_request("i0", "live", "interactive"))
    engine.add_request(_request("i1", "other", "interactive"))
    engine.step()
    assert _admitted(engine) == ["i0", "i1"]
    drain(engine)
    engine.close()


def test_an_interactive_request_takes_a_batch_row_at_once_and_the_batch_output_is_unchanged(
    llama: TinySetup,
) -> None:
    batch = [_request(f"b{i}", "offline", "batch", max_tokens=60) for i in range(2)]
    reference = make_engine(llama, max_num_seqs=2)
    for r in batch:
        reference.add_request(replace(r, priority="interactive"))
    alone = drain(reference)
    reference.close()

    engine = make_engine(llama, max_num_seqs=2, fair_wait_bound_s=0.0)  # no wait bound: the class alone
    for r in batch:
        engine.add_request(r)
    outputs: dict[str, list[Any]] = {}
    for _ in range(5):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert _admitted(engine) == ["b0", "b1"]  # free rows: batch takes them
    engine.add_request(_request("i0", "live", "interactive", max_tokens=4))
    for out in engine.step():
        outputs.setdefault(out.request_id, []).append(out)
    assert "i0" in _admitted(engine)  # the very next step
    assert engine.stats().preemptions_by_reason["batch"] == 1
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert engine.stats().preemptions_by_reason["batch"] == 1  # no churn after
    engine.close()
    for r in batch:
        assert _tokens(outputs[r.request_id]) == _tokens(alone[r.request_id])
    assert len(_tokens(outputs["i0"])) == 4


def test_interactive_requests_arriving_together_take_batch_rows_in_one_step(llama: TinySetup) -> None:
    """One batch row for each interactive request waiting, in the same step (one a step made the third
    of three arrivals wait three steps), and no more."""
    engine = make_engine(llama, max_num_seqs=4, fair_wait_bound_s=0.0)
    batch = [_request(f"b{i}", "offline", "batch", max_tokens=60) for i in range(4)]
    outputs, step = _stepping(engine, batch)
    for _ in range(3):
        step()
    assert _admitted(engine) == ["b0", "b1", "b2", "b3"]
    for i in range(3):
        engine.add_request(_request(f"i{i}", f"live{i}", "interactive", max_tokens=4))
    step()
    assert _admitted(engine) == ["b0", "i0", "i1", "i2"]  # the three newest batch rows gave way
    assert engine.stats().preemptions_by_reason["batch"] == 3
    drain(engine)
    engine.close()
    assert len(_tokens(outputs["b0"])) > 0


def test_a_batch_request_never_preempts_an_interactive_one(llama: TinySetup) -> None:
    engine = make_engine(llama, max_num_seqs=2, fair_wait_bound_s=0.01)
    engine.add_request(_request("i0", "live", "interactive", max_tokens=40))
    engine.add_request(_request("i1", "live", "interactive", max_tokens=40))
    engine.step()
    engine.add_request(_request("b0", "offline", "batch", max_tokens=4))  # least served, yet batch
    for _ in range(30):
        engine.step()
    assert _admitted(engine) == ["i0", "i1"]
    assert sum(engine.stats().preemptions_by_reason.values()) == 0
    drain(engine)
    engine.close()


def test_beside_interactive_work_a_step_computes_at_most_batch_step_tokens_of_the_batch_class(
    llama: TinySetup,
) -> None:
    """Alone, the batch class takes whole steps (its prompts' prefill in one); beside a running
    interactive sequence, at most `batch_step_tokens` of its tokens a step, decode rows included, and it
    still progresses to the same output."""
    batch = [_request(f"b{i}", "offline", "batch", max_tokens=12) for i in range(4)]
    reference = make_engine(llama, max_num_seqs=8)
    for r in batch:
        reference.add_request(replace(r, priority="interactive"))
    alone = drain(reference)
    reference.close()

    engine = make_engine(llama, max_num_seqs=8, batch_step_tokens=3)
    batch_tokens: list[int] = []
    schedule = engine.scheduler.schedule

    def recording() -> Any:
        out = schedule()
        batch_tokens.append(sum(s.num_tokens for s in out.scheduled if s.seq.batch))
        return out

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    outputs, step = _stepping(engine, batch)
    step()
    assert batch_tokens[-1] == 4 * 8  # alone: every prompt whole in the first step
    engine.add_request(_request("i0", "live", "interactive", max_tokens=30))
    beside: list[int] = []
    while engine.has_unfinished():
        interactive = any(not s.batch for s in engine.scheduler.running + list(engine.scheduler.waiting))
        step()
        if interactive:
            beside.append(batch_tokens[-1])
    engine.close()
    assert beside and max(beside) <= 3 and sum(beside) > 0  # capped, and progressing
    for r in batch:
        assert _tokens(outputs[r.request_id]) == _tokens(alone[r.request_id])
    assert len(_tokens(outputs["i0"])) == 30


def test_an_interactive_request_takes_a_slot_only_batch_sequences_use_at_once(llama: TinySetup) -> None:
    """One slot, held by long batch requests on adapter x: an interactive request on y takes it the next
    step (no wait bound, no residency), the batch ones resume after it with their output unchanged; a batch
    request never takes a slot from an interactive one."""
    x, y = llama.refs["demo-sql"], llama.refs["demo-poet"]
    batch = [replace(_request(f"b{i}", "offline", "batch", max_tokens=40), adapter=x) for i in range(2)]
    reference = make_engine(llama, max_loras=1, max_num_seqs=4)
    preload(reference, llama)
    for r in batch:
        reference.add_request(replace(r, priority="interactive"))
    alone = drain(reference)
    reference.close()

    # A wait bound and a residency far longer than the run: only the class moves the slot.
    engine = make_engine(
        llama, max_loras=1, max_num_seqs=4, adapter_wait_bound_s=3600, adapter_min_residency_s=3600
    )
    preload(engine, llama)
    outputs, step = _stepping(engine, batch)
    for _ in range(3):
        step()
    engine.add_request(replace(_request("i0", "live", "interactive", max_tokens=4), adapter=y))
    step()
    assert "i0" in _admitted(engine) and engine.stats().preemptions_by_reason["batch"] == 2
    engine.add_request(replace(_request("b2", "offline", "batch", max_tokens=4), adapter=x))
    while engine.has_unfinished():
        step()
    engine.close()
    assert engine.stats().preemptions_by_reason["batch"] == 2  # b2 waited for the slot: no taking back
    for r in batch:
        assert _tokens(outputs[r.request_id]) == _tokens(alone[r.request_id])
    assert len(_tokens(outputs["i0"])) == 4


def test_the_priority_class_is_checked() -> None:
    with pytest.raises(ValueError, match="priority"):
        _request("x", "t", "urgent")
