"""The engine request's priority class: "batch" sequences take only rows no "interactive" sequence wants.
They are admitted after every waiting interactive one, a waiting interactive one preempts the newest running
batch one at once (it resumes from the prefix cache, its output unchanged), and the class comes before the
fair order and FIFO. Driven through the real engine on the tiny model."""

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from adapters.ref import AdapterRef
from deployments.engine.interface import EngineRequest, SamplingParams
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.step_cost import StepCost, StepFit
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


def _work_per_step(engine: LLMEngine) -> list[tuple[int, int, int, int]]:
    """A list that the engine's steps fill from now on: each step's interactive tokens and sampled rows,
    then the batch class's."""
    work: list[tuple[int, int, int, int]] = []
    schedule = engine.scheduler.schedule

    def recording() -> Any:
        out = schedule()
        counts = [0, 0, 0, 0]
        for s in out.scheduled:
            at = 2 if s.seq.batch else 0
            counts[at] += s.num_tokens
            counts[at + 1] += bool(s.samples)
        work.append((counts[0], counts[1], counts[2], counts[3]))
        return out

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    return work


def _batch_tokens_per_step(engine: LLMEngine) -> list[int]:
    """A list that the engine's steps fill from now on: the batch-class tokens each step schedules."""
    batch_tokens: list[int] = []
    schedule = engine.scheduler.schedule

    def recording() -> Any:
        out = schedule()
        batch_tokens.append(sum(s.num_tokens for s in out.scheduled if s.seq.batch))
        return out

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    return batch_tokens


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
    batch_tokens = _batch_tokens_per_step(engine)
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


class _KnownCost(StepCost):
    """A step cost as a replica would have fitted it, fixed here: `fixed` s + `per_token` s a token +
    `per_row` s a sampled row."""

    def __init__(self, fixed: float, per_token: float, per_row: float = 0.0) -> None:
        super().__init__()
        self.known = StepFit(fixed, per_token, per_row)

    def observe(self, tokens: int, rows: int, seconds: float) -> None:
        pass

    def fit(self) -> StepFit | None:
        return self.known


@pytest.mark.parametrize(
    ("cost", "most"),
    [
        # A CPU-like cost: a token costs as much as the fixed part, so 10% of a step of a few interactive
        # tokens is under one token: one every few steps, as the share adds up, still progressing.
        ((0.001, 0.001), 1),
        # A GPU-like decode: the fixed part is 200 tokens' worth, so the count (3 of the 4 rows) binds.
        ((0.002, 0.00001), 3),
        # A CPU's decode row: a token is cheap, but a sampled row (logits, sampling, output) costs a fifth of
        # the step; a fit by tokens alone allowed the 3 of the cap here, each stretching the step by 17%, and
        # a row in every step stretched each by 17% where the slack meant 10%.
        ((0.01, 0.0001, 0.002), 1),
    ],
)
def test_beside_interactive_work_the_batch_class_adds_at_most_its_slack_of_the_steps_time(
    llama: TinySetup, cost: tuple[float, ...], most: int
) -> None:
    """`batch_step_slack`: beside interactive work the batch class's tokens are also bounded by the time
    they add, by the replica's fit of its step time (here given): over the steps, at most the slack of the
    interactive work's time (give or take the one token a step may owe), at most `batch_step_tokens` a
    step, and progressing; outputs unchanged."""
    batch = [_request(f"b{i}", "offline", "batch", max_tokens=10) for i in range(4)]
    reference = make_engine(llama, max_num_seqs=8)
    for r in batch:
        reference.add_request(replace(r, priority="interactive"))
    alone = drain(reference)
    reference.close()

    engine = make_engine(llama, max_num_seqs=8, batch_step_tokens=3, batch_step_slack=0.1)
    engine.scheduler.step_cost = _KnownCost(*cost)
    work = _work_per_step(engine)
    outputs, step = _stepping(engine, batch)
    step()
    engine.add_request(_request("i0", "live", "interactive", max_tokens=40))
    beside: list[tuple[int, int, int, int]] = []  # the work of each step with both classes in it
    while engine.has_unfinished():
        queued = engine.scheduler.running + list(engine.scheduler.waiting)
        both = any(not s.batch for s in queued) and any(s.batch for s in queued)
        step()
        if both:
            beside.append(work[-1])
    engine.close()
    fit = StepFit(*cost)
    batch_time = sum(fit.added(tokens, rows) for _, _, tokens, rows in beside)
    interactive_time = sum(fit.time(tokens, rows) for tokens, rows, _, _ in beside)
    assert batch_time <= 0.1 * interactive_time + fit.added(1, 1)  # on average within the slack
    assert max(tokens for *_, tokens, _ in beside) == most  # bounded a step
    assert sum(tokens for *_, tokens, _ in beside) >= len(beside) // 16  # and progressing
    for r in batch:
        assert _tokens(outputs[r.request_id]) == _tokens(alone[r.request_id])


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


def _first_batch_step_after_interactive_work(llama: TinySetup, window_s: float) -> int:
    engine = make_engine(llama, max_num_seqs=8, batch_step_tokens=3, batch_step_slack=None,
                         batch_interactive_window_s=window_s)  # fmt: skip
    engine.add_request(_request("i0", "live", "interactive", max_tokens=2))
    drain(engine)
    batch_tokens = _batch_tokens_per_step(engine)
    _, step = _stepping(engine, [_request(f"b{i}", "offline", "batch") for i in range(4)])
    step()
    drain(engine)
    engine.close()
    return batch_tokens[0]


def test_soon_after_interactive_work_a_batch_only_step_stays_small(llama: TinySetup) -> None:
    """`batch_interactive_window_s`: an interactive request arriving between others waits for the step under
    way, so for a while after interactive work a step of batch work alone is as small as beside it (the
    bench found a 156 ms step of 400 batch prompt tokens ahead of such a request); past the window, or
    with none, the batch class takes the whole step again."""
    assert _first_batch_step_after_interactive_work(llama, window_s=60.0) == 3
    assert _first_batch_step_after_interactive_work(llama, window_s=0.0) == 4 * 8


def _batch_beside_an_interactive_adapter(llama: TinySetup, window_s: float) -> tuple[bool, int]:
    """One slot for adapter A, used by an interactive request that has ended, one free; batch requests on
    B and C. Whether A was still resident once C ran, and the slot loads A's next request cost."""
    a, b, c = llama.refs["demo-sql"], llama.refs["demo-poet"], llama.refs["demo-chef"]
    engine = make_engine(
        llama,
        max_loras=2,
        lora_page_rank=16,
        max_num_seqs=8,
        adapter_min_residency_s=0,
        batch_interactive_window_s=window_s,
    )  # fmt: skip  (two adapters of any rank)
    preload(engine, llama)
    engine.add_request(replace(_request("i0", "live", "interactive"), adapter=a))
    drain(engine)
    engine.add_request(replace(_request("b-b", "offline", "batch"), adapter=b))
    engine.add_request(replace(_request("b-c", "offline", "batch"), adapter=c))
    a_kept = True
    while engine.has_unfinished():
        engine.step()
        if any(s.adapter == c for s in engine.scheduler.running):
            a_kept = a_kept and engine.adapters.slots.holds(a)
    loads = engine.adapters.slots.loads
    engine.add_request(replace(_request("i1", "live", "interactive"), adapter=a))
    drain(engine)
    engine.close()
    return a_kept, engine.adapters.slots.loads - loads


def test_the_batch_class_never_evicts_an_adapter_interactive_work_used_lately(llama: TinySetup) -> None:
    """Batch lines cycling through adapters evicted the slots of interactive users between their requests,
    whose next request then waited for a load (and, beside a batch, for a drain). Within the window the
    batch's C waits for B's slot and A's next request finds A resident; with no window, C takes A's slot."""
    assert _batch_beside_an_interactive_adapter(llama, window_s=60.0) == (True, 0)
    kept, loads = _batch_beside_an_interactive_adapter(llama, window_s=0.0)
    assert not kept and loads == 1


def test_an_interactive_request_takes_back_its_adapters_slot_from_a_drain_for_the_batch_class(
    llama: TinySetup,
) -> None:
    """One slot: a batch request decodes on A, and a batch request on B waits, so A's slot drains for B. An
    interactive request on A then joins A's slot at once (the drain stops) instead of waiting for the batch
    request to finish and A to be loaded again (or preempting it and loading A again); B's turn comes
    after."""
    a, b = llama.refs["demo-sql"], llama.refs["demo-poet"]
    engine = make_engine(llama, max_loras=1, max_num_seqs=8, adapter_min_residency_s=0,
                         batch_interactive_window_s=0)  # fmt: skip
    preload(engine, llama)
    outputs, step = _stepping(
        engine, [replace(_request("b-a", "offline", "batch", max_tokens=20), adapter=a)]
    )
    step()
    engine.add_request(replace(_request("b-b", "offline", "batch"), adapter=b))
    step()
    assert engine.adapters.slots.draining() == [0]
    loads = engine.adapters.slots.loads
    engine.add_request(replace(_request("i-a", "live", "interactive"), adapter=a))
    step()
    assert _admitted(engine) == ["b-a", "i-a"] and engine.adapters.slots.draining() == []
    assert engine.adapters.slots.loads == loads  # A stayed: no load, and the batch request kept its row
    while engine.has_unfinished():
        step()
    engine.close()
    assert outputs["b-b"][-1].finish_reason is not None and outputs["i-a"][-1].finish_reason is not None
    assert len(_tokens(outputs["i-a"])) == 6 and len(_tokens(outputs["b-b"])) == 6


def _three_slots_beside_a_batch(
    llama: TinySetup,
) -> tuple[LLMEngine, tuple[AdapterRef, ...], tuple[int, int, int]]:
    """Three slots: A's and D's used by a batch request each, C's by an interactive one (30 tokens each,
    one step in). The engine, the refs A, B (cold), C, D, and the slots of A, C and D."""
    a, b, c, d = (llama.refs[name] for name in ("demo-sql", "demo-poet", "demo-chef", "demo-pirate"))
    engine = make_engine(llama, max_loras=3, lora_page_rank=16, adapter_min_residency_s=0)
    preload(engine, llama)
    _, step = _stepping(
        engine,
        [
            replace(_request("b-a", "offline", "batch", max_tokens=30), adapter=a),
            replace(_request("b-d", "offline", "batch", max_tokens=30), adapter=d),
            replace(_request("i-c", "live", "interactive", max_tokens=30), adapter=c),
        ],
    )
    step()
    slot_a, slot_c, slot_d = (engine.adapters.slots.lookup(ref) for ref in (a, c, d))
    assert slot_a is not None and slot_c is not None and slot_d is not None
    return engine, (a, b, c, d), (slot_a, slot_c, slot_d)


def test_an_interactive_request_takes_back_its_adapters_slot_from_a_drain_for_another_interactive_one(
    llama: TinySetup,
) -> None:
    """Three slots: A's and D's used only by batch requests, C's by an interactive one; an interactive
    request waits for cold B, so A's slot (its users finish first) drains for it. An interactive request
    on A joins A's slot (the drain stops; the next plan drains D's) instead of waiting for the batch request
    at the class's capped rate and then for A to be loaded again: the bench's TTFT tail beside a batch
    (250-400 ms). With no slot only the batch class uses to move to, the drain stays
    (test_engine_behaviour: a steady stream on a hot adapter does not starve a cold one)."""
    engine, (a, b, c, _), (slot_a, slot_c, slot_d) = _three_slots_beside_a_batch(llama)
    manager = engine.adapters
    manager.plan([b], {slot_a: 5, slot_c: 29, slot_d: 29}, [b], frozenset({b, c}), frozenset({b}))
    assert manager.slots.draining() == [slot_a]  # the batch-only slot whose users finish first
    assert manager.acquire(a) == slot_a and manager.slots.draining() == []
    manager.release(slot_a)
    manager.plan([b], {slot_a: 5, slot_c: 29, slot_d: 29}, [b], frozenset({a, b, c}), frozenset({a, b}))
    assert manager.slots.draining() == [slot_d]  # the drain moved
    drain(engine)
    engine.close()


@pytest.mark.parametrize("judged_by", ["current users", "window"])
def test_a_drain_moves_to_a_slot_interactive_work_used_lately_but_not_now(
    llama: TinySetup, judged_by: str
) -> None:
    """As above, but D's adapter served an interactive request within batch_interactive_window_s and serves
    none now: the request on A still takes its slot back and the drain moves to D. A request waiting now
    outweighs one that may come back to D (the waits left beside a batch were such drains). Judged by the
    window alone (no current set given), the drain stays and the request on A waits."""
    engine, (a, b, c, d), (slot_a, slot_c, slot_d) = _three_slots_beside_a_batch(llama)
    manager = engine.adapters
    remaining = {slot_a: 5, slot_c: 29, slot_d: 29}
    by_users = judged_by == "current users"
    manager.plan(
        [b], remaining, [b], frozenset({b, c, d}), frozenset({b}), frozenset({b, c}) if by_users else None
    )
    assert manager.slots.draining() == [slot_a]
    if not by_users:
        assert manager.acquire(a) is None and manager.slots.draining() == [slot_a]
    else:
        assert manager.acquire(a) == slot_a and manager.slots.draining() == []
        manager.release(slot_a)
        manager.plan([b], remaining, [b], frozenset({a, b, c, d}), frozenset({a, b}), frozenset({a, b, c}))
        assert manager.slots.draining() == [slot_d]  # the drain moved to the slot no one uses now
    drain(engine)
    engine.close()


def _claim_beside_an_idle_young_slot(llama: TinySetup, waited_for: frozenset[str]) -> tuple[bool, bool]:
    """Two slots: A idle, just loaded (its minimum residency far off) and queued for; C busy. An interactive
    claim for B: whether it got a slot, and whether A is still resident."""
    a, b, c = llama.refs["demo-sql"], llama.refs["demo-poet"], llama.refs["demo-chef"]
    engine = make_engine(llama, max_loras=2, lora_page_rank=16, adapter_min_residency_s=3600)
    preload(engine, llama)
    engine.add_request(replace(_request("i-a", "live", "interactive", max_tokens=2), adapter=a))
    drain(engine)
    _, step = _stepping(engine, [replace(_request("i-c", "live", "interactive", max_tokens=30), adapter=c)])
    step()
    manager = engine.adapters
    slot_c = manager.slots.lookup(c)
    assert slot_c is not None and manager.slots.lookup(a) is not None
    refs = {"A": a, "B": b}
    manager.plan([a, b], {slot_c: 29}, [b], frozenset({b, c}), frozenset(refs[n] for n in waited_for))
    slot = manager.acquire(b)
    kept = manager.slots.holds(a)
    if slot is not None:
        manager.release(slot)
    drain(engine)
    engine.close()
    return slot is not None, kept


def test_an_interactive_claim_evicts_an_idle_slot_only_batch_lines_queue_for(llama: TinySetup) -> None:
    """A young slot with requests queued is kept for its minimum residency; beside a batch its queue was
    often batch lines held back by the class's share of a step, and interactive requests waited for a
    slot beside free rows. An interactive claim now evicts it unless interactive requests wait for it."""
    assert _claim_beside_an_idle_young_slot(llama, frozenset({"B"})) == (True, False)
    assert _claim_beside_an_idle_young_slot(llama, frozenset({"A", "B"})) == (False, True)
