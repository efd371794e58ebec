"""Continuous batching, chunked prefill, aborts, sampling controls and live adapter changes."""

import threading

import pytest

from adapters.errors import AdapterNotFound
from adapters.store import AdapterStore
from deployments.engine.interface import EngineRequest, FinishReason
from deployments.engine.outputs import RequestOutput
from deployments.engine.sampling_params import SamplingParams
from tests.engine.helpers import copy_adapter, drain, make_engine, preload, text, tokens
from tests.engine.reference import PeftReference
from tests.model_fixtures import TinySetup

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_long_prompt_is_chunked_and_never_freezes_running_decodes(llama: TinySetup) -> None:
    engine = make_engine(llama, max_num_batched_tokens=32)
    engine.add_request(
        EngineRequest("short", [1, 2, 3, 4], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    )
    engine.step()
    engine.step()
    engine.add_request(
        EngineRequest("long", list(range(10, 170)), GREEDY)
    )  # 160 tokens, a budget of 32 per step
    long = engine.group("long")[0]
    steps_with_short_token = steps_while_prefilling = 0
    while long.num_computed < len(long.prompt_ids):
        outs = engine.step()
        steps_while_prefilling += 1
        steps_with_short_token += any(o.request_id == "short" and o.token_ids for o in outs)
    assert steps_while_prefilling >= 4  # the prompt really was split
    assert steps_with_short_token == steps_while_prefilling  # a token every step: never frozen
    drain(engine)
    engine.close()


def test_a_lone_long_prompt_is_prefilled_over_several_steps(llama: TinySetup) -> None:
    """Steps that only advance a prefill chunk sample nothing; they must still run."""
    engine = make_engine(llama, max_num_batched_tokens=32)
    engine.add_request(EngineRequest("alone", list(range(10, 110)), GREEDY))
    outputs = drain(engine)["alone"]
    assert engine.counters.steps >= 4 + 11  # four chunks, then decodes
    assert len(tokens(outputs)) == 12
    engine.close()


def test_requests_join_and_leave_every_step(llama: TinySetup) -> None:
    engine = make_engine(llama)
    engine.add_request(
        EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    )
    engine.add_request(
        EngineRequest("b", [4, 5, 6], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    )
    finished_at: dict[str, int] = {}
    for step in range(30):
        if step == 2:
            engine.add_request(
                EngineRequest("c", [7, 8, 9], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
            )
        for out in engine.step():
            if out.finished:
                finished_at[out.request_id] = step
        if not engine.has_unfinished():
            break
    # a leaves after its 3 tokens while b keeps going; c joins mid-flight and leaves before b.
    assert finished_at["a"] < finished_at["c"] < finished_at["b"]
    engine.close()


def test_abort_frees_blocks_and_slot_and_reports_usage(llama: TinySetup) -> None:
    engine = make_engine(llama)
    preload(engine, llama)
    engine.add_request(
        EngineRequest(
            "x", list(range(1, 30)), SamplingParams(max_tokens=50, temperature=0), llama.refs["demo-sql"]
        )
    )
    for _ in range(3):
        engine.step()
    [out] = engine.abort("x")
    assert out.finished
    assert out.finish_reason is FinishReason.ABORT
    assert out.usage is not None
    assert out.usage.prompt_tokens == 29
    assert out.usage.completion_tokens == 3
    assert out.usage.gpu_ms > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert all(engine.adapters.slots.users(s) == 0 for s in range(4))
    assert not engine.has_unfinished()
    assert engine.abort("x") == []  # already gone
    engine.close()


def test_seeded_sampling_is_reproducible_whatever_the_batch(llama: TinySetup) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    engine = make_engine(llama)
    engine.add_request(EngineRequest("alone", [3, 1, 4, 1, 5], params))
    alone = tokens(drain(engine)["alone"])
    engine.add_request(EngineRequest("n1", [9, 9, 9], SamplingParams(max_tokens=20, temperature=1.0)))
    engine.add_request(EngineRequest("crowd", [3, 1, 4, 1, 5], params))
    engine.add_request(
        EngineRequest(
            "n2", [2, 7, 1, 8], SamplingParams(max_tokens=5, temperature=0.5), llama.refs["demo-poet"]
        )
    )
    crowd = tokens(drain(engine)["crowd"])
    assert crowd == alone
    other_seed = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=99, ignore_eos=True)
    engine.add_request(EngineRequest("other", [3, 1, 4, 1, 5], other_seed))
    assert tokens(drain(engine)["other"]) != alone
    engine.close()


def test_stop_strings_stop_tokens_and_max_tokens(llama: TinySetup) -> None:
    engine = make_engine(llama)
    prompt = [11, 12, 13, 14]
    engine.add_request(
        EngineRequest("free", prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    )
    free = drain(engine)["free"]
    full_text, full_tokens = text(free), tokens(free)
    assert free[-1].finish_reason is FinishReason.LENGTH
    assert len(full_tokens) == 24

    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]  # likely spans a token boundary
    assert stop
    engine.add_request(
        EngineRequest(
            "stop-str", prompt, SamplingParams(max_tokens=24, temperature=0, stop=(stop,), ignore_eos=True)
        )
    )
    out = drain(engine)["stop-str"]
    assert out[-1].finish_reason is FinishReason.STOP
    assert out[-1].stop_reason == stop
    assert text(out) == full_text[: full_text.index(stop)]

    stop_token = full_tokens[5]
    engine.add_request(
        EngineRequest(
            "stop-tok",
            prompt,
            SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(stop_token,), ignore_eos=True),
        ),
    )
    out = drain(engine)["stop-tok"]
    assert out[-1].finish_reason is FinishReason.STOP
    assert out[-1].stop_reason == stop_token
    assert tokens(out) == full_tokens[: full_tokens.index(stop_token) + 1]
    engine.close()


def test_eos_ends_generation(llama: TinySetup) -> None:
    engine = make_engine(llama)
    eos = min(engine.loaded.eos_token_ids)
    engine.add_request(
        EngineRequest("e", [1, 2, 3], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    )
    free = tokens(drain(engine)["e"])
    # Make EOS the greedy choice after 3 tokens by stopping on that token id as EOS would.
    engine.outputs.eos_token_ids = frozenset({free[2]})
    engine.add_request(EngineRequest("e2", [1, 2, 3], SamplingParams(max_tokens=24, temperature=0)))
    out = drain(engine)["e2"]
    assert tokens(out) == free[:3]
    assert out[-1].finish_reason is FinishReason.STOP
    assert out[-1].stop_reason is None  # EOS, not a user stop
    engine.outputs.eos_token_ids = frozenset({eos})
    engine.close()


def test_new_version_serves_new_requests_while_old_ones_finish_on_theirs(llama: TinySetup, tmp_path) -> None:
    store = AdapterStore(llama.store_root)
    v1_dir = llama.adapter_dirs["demo-sql"]
    v2_dir = copy_adapter(llama.adapter_dirs["demo-pirate"], tmp_path / "v2")  # different weights, same id
    ref_v1 = store.put_dir("swap-me", v1_dir)
    engine = make_engine(llama)
    long = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest("old", [5, 6, 7, 8], long, ref_v1))
    collected: dict[str, list[RequestOutput]] = {"old": [], "new": []}
    for _ in range(5):
        for out in engine.step():
            collected[out.request_id].append(out)
    ref_v2 = store.put_dir("swap-me", v2_dir)
    assert ref_v2.version == ref_v1.version + 1
    engine.add_request(EngineRequest("new", [5, 6, 7, 8], long, store.latest("swap-me")))
    for rid, outs in drain(engine).items():
        collected[rid].extend(outs)

    reference = PeftReference(llama.model_dir, {"v1": v1_dir, "v2": v2_dir})
    assert tokens(collected["old"]) == reference.greedy([5, 6, 7, 8], "v1", 30)
    assert tokens(collected["new"]) == reference.greedy([5, 6, 7, 8], "v2", 30)
    store.delete("swap-me")
    engine.close()


def test_removed_adapter_lets_running_requests_finish_and_refuses_new_ones(
    llama: TinySetup, tmp_path
) -> None:
    store = AdapterStore(llama.store_root)
    ref = store.put_dir("doomed", llama.adapter_dirs["demo-legal"])
    engine = make_engine(llama)
    pending = engine.adapters.prefetch(ref)
    assert pending is not None  # a new adapter is not resident yet
    pending.result()
    engine.add_request(
        EngineRequest(
            "running", [1, 2, 3], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), ref
        )
    )
    for _ in range(4):
        engine.step()
    assert engine.scheduler.running  # it is mid-generation when the adapter goes
    store.delete("doomed")
    engine.adapters.remove("doomed")
    with pytest.raises(AdapterNotFound):
        engine.add_request(EngineRequest("late", [1, 2, 3], GREEDY, ref))
    out = drain(engine)["running"]
    assert out[-1].finish_reason is FinishReason.LENGTH
    assert len(tokens(out)) >= 16
    assert not engine.adapters.slots.holds(ref)  # its slot was freed once the last user left
    assert ref not in engine.adapters.cpu.resident()
    engine.close()


def test_a_request_waits_only_for_its_own_adapter(llama: TinySetup) -> None:
    engine = make_engine(llama)
    release = threading.Event()
    real_loader = engine.adapters.cpu._loader

    def slow_loader(ref):
        release.wait(timeout=30)
        return real_loader(ref)

    engine.adapters.cpu._loader = slow_loader
    engine.add_request(EngineRequest("cold", [1, 2, 3], GREEDY, llama.refs["demo-chef"]))
    engine.add_request(EngineRequest("base", [4, 5, 6], GREEDY))
    progressed = 0
    for _ in range(8):
        outs = engine.step()
        progressed += any(o.request_id == "base" for o in outs)
        assert not any(o.request_id == "cold" for o in outs)
    assert progressed == 8  # the base request decoded every step while the adapter was loading
    release.set()
    assert drain(engine)["cold"][-1].finish_reason is FinishReason.LENGTH
    engine.close()


def test_more_active_adapters_than_slots_does_not_starve_anyone(llama: TinySetup) -> None:
    # No minimum residency: the hot slot drains for the cold adapter at once (steps here are milliseconds).
    engine = make_engine(llama, max_loras=1, adapter_min_residency_s=0)
    preload(engine, llama)
    hot, cold = llama.refs["demo-sql"], llama.refs["demo-poet"]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest("hot-0", [1, 2], params, hot))
    engine.step()
    engine.add_request(EngineRequest("cold", [3, 4], params, cold))
    cold_done_at = None
    for step in range(200):  # a steady stream of requests for the resident adapter
        engine.add_request(EngineRequest(f"hot-{step + 1}", [1, 2], params, hot))
        if any(o.request_id == "cold" and o.finished for o in engine.step()):
            cold_done_at = step
            break
    assert cold_done_at is not None
    assert cold_done_at < 30
    engine.close()


def test_pinned_adapter_stays_in_its_slot(llama: TinySetup) -> None:
    engine = make_engine(llama, max_loras=2)
    preload(engine, llama)
    pinned = llama.refs["demo-legal"]
    engine.adapters.pin(pinned)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for i, name in enumerate(["demo-sql", "demo-poet", "demo-pirate", "demo-chef", "demo-sql"]):
        engine.add_request(EngineRequest(f"r{i}", [1, 2, 3], params, llama.refs[name]))
        drain(engine)
        assert engine.adapters.slots.holds(pinned)
    assert engine.adapters.slots.evictions >= 3  # the other slot churned
    engine.close()
