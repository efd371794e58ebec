"""The adapter tiers follow the queue: queued adapters load ahead of admission, slots that queued requests
want are neither evicted nor drained while another would do, and a cold adapter's wait stays bounded."""

import threading
import time
from pathlib import Path

import pytest

from adapters.ref import AdapterRef
from deployments.engine.interface import EngineRequest, FinishReason
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.sampling_params import SamplingParams
from tests.engine.helpers import drain, make_engine, preload
from tests.model_fixtures import TinySetup

WAIT = 10.0  # seconds; reached only if a load hangs


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def test_adapters_of_queued_requests_load_into_cpu_memory_before_their_turn(llama: TinySetup) -> None:
    engine = make_engine(llama, max_num_seqs=1)
    names = ["demo-chef", "demo-sql", "demo-poet"]
    engine.add_request(EngineRequest("long", [1, 2, 3], greedy(200)))  # holds the only seat
    engine.step()
    for i, name in enumerate(names):
        engine.add_request(EngineRequest(f"q{i}", [4, 5, 6], greedy(2), llama.refs[name]))
    deadline = time.monotonic() + WAIT
    while set(engine.adapters.cpu.resident()) < {llama.refs[n] for n in names}:
        assert time.monotonic() < deadline, (
            f"queued adapters not prefetched: {engine.adapters.cpu.resident()}"
        )
        engine.step()
        time.sleep(0.01)
    assert [s.request_id for s in engine.scheduler.running] == ["long"]  # nobody was admitted meanwhile
    assert engine.adapters.cpu.loads == 3
    engine.close()


def test_the_slot_no_queued_request_wants_drains_for_a_cold_adapter(llama: TinySetup) -> None:
    engine = make_engine(llama, max_loras=2, max_num_seqs=3, adapter_min_residency_s=0)
    preload(engine, llama)
    hot, other, cold = (llama.refs[n] for n in ("demo-chef", "demo-sql", "demo-poet"))
    engine.add_request(EngineRequest("hot-0", [1, 2], greedy(40), hot))  # one user of the hot slot
    engine.add_request(EngineRequest("other-0", [1, 2], greedy(40), other))  # two users of the other
    engine.add_request(EngineRequest("other-1", [3, 4], greedy(40), other))
    engine.step()
    engine.add_request(EngineRequest("hot-1", [5, 6], greedy(4), hot))  # queued: the batch is full
    engine.add_request(EngineRequest("cold-0", [7, 8], greedy(4), cold))
    engine.step()
    slots = engine.adapters.slots
    # The fewest users would pick the hot slot; queued demand says the other one.
    assert slots.lookup(hot) is not None and slots.holds(other) and slots.lookup(other) is None
    outputs = drain(engine)
    assert all(outs[-1].finish_reason is FinishReason.LENGTH for outs in outputs.values())
    assert slots.holds(hot) and slots.holds(cold)
    engine.close()


def test_a_cold_adapter_waits_a_bounded_time_under_a_flood_of_hot_requests(llama: TinySetup) -> None:
    engine = make_engine(llama, max_loras=2, max_num_seqs=4, adapter_min_residency_s=0)
    preload(engine, llama)
    hot = [llama.refs["demo-chef"], llama.refs["demo-sql"]]
    cold = llama.refs["demo-poet"]
    for i in range(4):
        engine.add_request(EngineRequest(f"hot-{i}", [1, 2], greedy(6), hot[i % 2]))
    engine.step()
    engine.add_request(EngineRequest("cold", [3, 4], greedy(4), cold))
    done_at = None
    for step in range(300):  # both hot adapters always have requests queued
        for k in range(2):
            engine.add_request(EngineRequest(f"hot-{step}-{k}", [1, 2], greedy(6), hot[k]))
        if any(o.request_id == "cold" and o.finished for o in engine.step()):
            done_at = step
            break
    # A drain lasts at most one hot request (6 tokens); the cold request then decodes 4.
    assert done_at is not None and done_at < 20, done_at
    engine.close()


def test_an_overdue_adapter_takes_a_busy_slot_and_the_preempted_request_resumes_unchanged(
    llama: TinySetup,
) -> None:
    hot, cold = llama.refs["demo-chef"], llama.refs["demo-poet"]
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    solo = make_engine(llama, max_loras=1, adapter_wait_bound_s=0)
    preload(solo, llama)
    solo.add_request(EngineRequest("long", prompt, greedy(120), hot))
    expected = [t for o in drain(solo)["long"] for t in o.token_ids]
    solo.close()

    engine = make_engine(llama, max_loras=1, adapter_wait_bound_s=0.2, adapter_min_residency_s=0.2)
    preload(engine, llama)
    engine.add_request(EngineRequest("long", prompt, greedy(120), hot))
    outputs: dict[str, list[int]] = {"long": [], "cold": []}
    for _ in range(3):
        outputs["long"] += [t for out in engine.step() for t in out.token_ids]
    engine.add_request(EngineRequest("cold", [7, 8], greedy(2), cold))
    started = time.monotonic()
    cold_done = long_done = None
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.token_ids
            if out.finished:
                assert out.finish_reason is FinishReason.LENGTH, out
                if out.request_id == "cold":
                    cold_done = time.monotonic() - started
                else:
                    long_done = time.monotonic() - started
        time.sleep(0.005)  # ~25 steps per 0.2 s: the long request would hold the slot for 120
    assert cold_done is not None and long_done is not None
    assert cold_done < long_done  # it did not wait for the slot to drain
    # At least the one preemption; on a loaded machine, where two steps can outlast the wait bound, the long
    # request may be overdue in its turn while the cold one still decodes, and take the slot back.
    assert engine.scheduler.slot_preemptions >= 1
    assert outputs["long"] == expected  # preempted and resumed from the prefix cache: same tokens
    engine.close()


def test_an_overdue_wide_adapter_frees_its_whole_run_in_one_step(llama: TinySetup) -> None:
    """Pages of 4: demo-pirate (rank 4) takes page 0, demo-sql (rank 8) pages 1-2, one page stays free.
    demo-poet (rank 16) needs all four: once overdue it preempts both narrow adapters' requests in the
    same step and takes its run then, instead of one victim a step; both resume with unchanged tokens."""
    narrow = {"pirate": llama.refs["demo-pirate"], "sql": llama.refs["demo-sql"]}
    wide = llama.refs["demo-poet"]
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    solo = make_engine(llama, max_loras=1, lora_page_rank=4, adapter_wait_bound_s=0)
    preload(solo, llama)
    for name, ref in narrow.items():
        solo.add_request(EngineRequest(name, prompt, greedy(150), ref))
    expected = {rid: [t for o in outs for t in o.token_ids] for rid, outs in drain(solo).items()}
    solo.close()

    engine = make_engine(
        llama, max_loras=1, lora_page_rank=4, adapter_wait_bound_s=0.2, adapter_min_residency_s=0.1
    )
    preload(engine, llama)
    assert engine.adapters.slots.num_slots == 4
    for name, ref in narrow.items():
        engine.add_request(EngineRequest(name, prompt, greedy(150), ref))
    outputs: dict[str, list[int]] = {"pirate": [], "sql": [], "poet": []}
    for _ in range(3):
        for out in engine.step():
            outputs[out.request_id] += out.token_ids
    engine.add_request(EngineRequest("poet", [7, 8], greedy(2), wide))
    resident_when_preempted = None
    while engine.has_unfinished():
        before = engine.scheduler.slot_preemptions
        for out in engine.step():
            outputs[out.request_id] += out.token_ids
        if before == 0 and engine.scheduler.slot_preemptions > 0:
            resident_when_preempted = engine.adapters.slots.lookup(wide) is not None
            assert engine.scheduler.slot_preemptions == 2, "both narrow runs give way in one step"
        time.sleep(0.005)
    assert resident_when_preempted is True, "the wide adapter took its run in the step that freed it"
    assert outputs["pirate"] == expected["pirate"] and outputs["sql"] == expected["sql"]
    assert len(outputs["poet"]) == 2
    engine.close()


def first_tokens_in_first_step(engine: LLMEngine, requests: list[EngineRequest]) -> set[str]:
    for request in requests:
        engine.add_request(request)
    return {out.request_id for out in engine.step() if out.token_ids}


def test_a_quick_read_of_a_cold_adapter_is_waited_for_so_its_request_starts_in_the_first_step(
    llama: TinySetup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read shorter than the bound is waited for once: an interactive request for an adapter in neither
    tier gets its first token from the step it arrived before, like a request for a resident one."""
    cold = llama.refs["demo-chef"]
    engine = make_engine(llama, adapter_read_wait_s=WAIT)  # far above any read of a tiny adapter
    assert engine.adapters.cpu.get(cold) is None
    started = first_tokens_in_first_step(engine, [EngineRequest("cold", [1, 2, 3], greedy(2), cold)])
    assert started == {"cold"}
    assert engine.adapters.read_waits == engine.stats().adapter_read_waits == 1
    engine.close()

    batch = make_engine(llama, adapter_read_wait_s=WAIT)  # the batch class never makes others wait
    gate = threading.Event()  # the read stays in flight until the step is over: no race with a quick read
    path = batch.adapters.store.path

    def gated_path(ref: AdapterRef) -> Path:
        gate.wait(WAIT)
        return path(ref)

    monkeypatch.setattr(batch.adapters.store, "path", gated_path)
    request = EngineRequest("line", [1, 2, 3], greedy(2), cold, priority="batch")
    assert first_tokens_in_first_step(batch, [request]) == set()
    assert batch.adapters.read_waits == 0 and cold in batch.adapters.cpu.loading()  # stepped on without it
    gate.set()
    assert drain(batch)["line"][-1].finish_reason is FinishReason.LENGTH
    batch.close()


def test_a_slow_store_is_never_waited_for(llama: TinySetup, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once reads take longer than the bound, a cold adapter's read overlaps the steps again: the running
    requests do not wait for it, and its request starts once it is in."""
    sql, chef = llama.refs["demo-sql"], llama.refs["demo-chef"]
    engine = make_engine(llama, adapter_read_wait_s=0.05)
    gates = {sql: threading.Event(), chef: threading.Event()}  # each read stays in flight until its gate
    path = engine.adapters.store.path

    def slow_path(ref: AdapterRef) -> Path:
        gates[ref].wait(WAIT)
        return path(ref)

    monkeypatch.setattr(engine.adapters.store, "path", slow_path)
    assert first_tokens_in_first_step(engine, [EngineRequest("first", [1, 2], greedy(2), sql)]) == set()
    assert engine.adapters.read_waits == 1  # no read was timed yet: the first one is waited for, in vain
    time.sleep(0.1)
    gates[sql].set()
    drain(engine)
    assert engine.adapters.cpu.recent_load_s > 0.05
    started = first_tokens_in_first_step(engine, [EngineRequest("second", [1, 2], greedy(2), chef)])
    assert started == set() and engine.adapters.read_waits == 1  # this read is not waited for
    gates[chef].set()
    assert drain(engine)["second"][-1].finish_reason is FinishReason.LENGTH
    engine.close()
