"""Admission rotates among waiting adapters: an adapter without a usable slot waits in a round robin (it joins
at its oldest waiting request, or when it last held a slot if later), so a hot adapter that gave up its slot
queues behind every adapter that waited meanwhile; a slot with requests queued or running is kept for
`adapter_min_residency_s`, so the number of slot loads follows the adapters, not the requests; and the
rotation comes after the class and the least-served tenant. Driven through the real engine on the tiny
model; the wait bound is off (0) so only the rotation and the drains decide."""

from typing import Any

import pytest

from deployments.engine.interface import EngineRequest, FinishReason, SamplingParams
from deployments.engine.llm_engine import LLMEngine
from tests.engine.helpers import drain, make_engine, preload, queued_adapters
from tests.model_fixtures import TinySetup

_first = iter(range(13, 100_000, 41))


def _request(rid: str, adapter: Any, max_tokens: int, tenant: str | None = None) -> EngineRequest:
    first = next(_first) % 900 + 10  # distinct prompts: no prefix-cache hits between requests
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    prompt = [first, *((first + k) % 1000 + 1 for k in range(1, 6))]
    return EngineRequest(rid, prompt, params, adapter, cache_salt=tenant, tenant=tenant)


def _engine(llama: TinySetup, **overrides: Any) -> LLMEngine:
    settings: dict[str, Any] = {"adapter_wait_bound_s": 0, "adapter_min_residency_s": 0}
    engine = make_engine(llama, **{**settings, **overrides})
    preload(engine, llama)  # the schedule does not depend on store reads
    return engine


def test_a_hot_adapter_cannot_starve_the_adapters_waiting_behind_it(llama: TinySetup) -> None:
    # One slot, four rows. The hot adapter gets a new request every step, so its oldest queued request is
    # always older than any cold one's: in arrival order it would take the slot back each time it frees.
    engine = _engine(llama, max_loras=1, max_num_seqs=4)
    hot, *cold = (llama.refs[n] for n in ("demo-chef", "demo-sql", "demo-poet", "demo-pirate"))
    for i in range(8):  # a backlog: it runs four, four wait, and more arrive every step
        engine.add_request(_request(f"hot-pre-{i}", hot, 6))
    engine.step()
    for i, ref in enumerate(cold):
        engine.add_request(_request(f"cold-{i}", ref, 4))
    done: dict[str, int] = {}
    for step in range(400):
        engine.add_request(_request(f"hot-{step}", hot, 6))
        for out in engine.step():
            if out.finished:
                assert out.finish_reason is FinishReason.LENGTH, out
                done[out.request_id] = step
        if all(f"cold-{i}" in done for i in range(len(cold))):
            break
    engine.close()
    assert all(f"cold-{i}" in done for i in range(len(cold))), done
    waits = [done[f"cold-{i}"] for i in range(len(cold))]
    # A cold adapter's turn costs at most one drain of a slot (a hot request lasts 6 steps) and its own 4
    # tokens, in the order the adapters joined the rotation.
    assert waits == sorted(waits)
    assert max(waits) < 15 * len(cold), waits


@pytest.mark.parametrize("per_adapter", [1, 3, 6])
def test_slot_loads_follow_the_adapters_not_the_waiting_requests(llama: TinySetup, per_adapter: int) -> None:
    # Five adapters on two slots and two rows, every request queued at once, interleaved by adapter. A slot
    # whose adapter still has requests queued or running is kept (minimum residency longer than the run),
    # so each adapter is loaded once however many requests wait for it.
    engine = _engine(llama, max_loras=2, max_num_seqs=2, adapter_min_residency_s=3600)
    refs = list(llama.refs.values())
    for k in range(per_adapter):
        for i, ref in enumerate(refs):
            engine.add_request(_request(f"a{i}-{k}", ref, 3))
    outputs = drain(engine)
    loads = engine.adapters.slots.loads
    engine.close()
    assert len(outputs) == len(refs) * per_adapter
    assert all(outs[-1].finish_reason is FinishReason.LENGTH for outs in outputs.values())
    assert loads == len(refs)


def test_a_held_adapter_queues_behind_one_that_waited_even_with_older_requests(llama: TinySetup) -> None:
    # One slot, one row. x-1 (on the resident adapter) queues before y-1 (on a cold one). The slot drains
    # for y's turn; when it frees, y goes first: x held the slot last, so it rejoins the rotation now.
    engine = _engine(llama, max_loras=1, max_num_seqs=1)
    x, y = llama.refs["demo-sql"], llama.refs["demo-poet"]
    engine.add_request(_request("x-0", x, 8))
    engine.step()
    engine.add_request(_request("x-1", x, 2))
    engine.add_request(_request("y-1", y, 2))
    first: list[str] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_ids and out.request_id not in first:
                first.append(out.request_id)
    loads = engine.adapters.slots.loads
    engine.close()
    assert first == ["x-0", "y-1", "x-1"]
    assert loads == 3  # x, y, x again: one turn each


def test_the_least_served_tenant_comes_before_the_rotation(llama: TinySetup) -> None:
    # One slot, one row. heavy's long request runs on adapter x; meanwhile heavy queues one more request on
    # x and one on z (z joins the rotation first), then light, served least, queues one on w. When x's
    # request ends, light's adapter w takes the slot: the tenant comes before the adapter rotation (without
    # it, z, first to join the rotation, would take the slot).
    engine = _engine(llama, max_loras=1, max_num_seqs=1)
    x, z, w = (llama.refs[n] for n in ("demo-sql", "demo-poet", "demo-pirate"))
    engine.add_request(_request("heavy-0", x, 12, "heavy"))
    engine.step()
    engine.add_request(_request("heavy-x", x, 2, "heavy"))
    engine.add_request(_request("heavy-z", z, 2, "heavy"))
    engine.step()
    engine.add_request(_request("light-w", w, 2, "light"))
    first: list[str] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_ids and out.request_id not in first:
                first.append(out.request_id)
    engine.close()
    assert first[:2] == ["heavy-0", "light-w"], first
    assert sorted(first) == sorted(["heavy-0", "heavy-x", "heavy-z", "light-w"])


def test_stats_name_the_deepest_adapter_queues_and_the_rotation_bounded_to_the_top_adapters(
    llama: TinySetup,
) -> None:
    engine, (x, y, z, _) = queued_adapters(llama)  # x runs; y, z and w queue 3, 2 and 1
    stats = engine.stats()
    assert stats.adapter_queue == {str(y): 3, str(z): 2}  # the deepest two; w's one is summed
    assert (stats.adapter_queue_other, stats.adapters_queued) == (1, 3)
    assert stats.adapter_rotation == [str(y), str(z)]  # the first two to get a slot, in arrival order
    assert stats.resident_ranks == {str(x): engine.adapters.specs.cached(x).max_rank}  # type: ignore[union-attr]
    drain(engine)
    stats = engine.stats()  # at once: a drained queue is never shown from the cache
    engine.close()
    assert stats.adapter_queue == {} and stats.adapter_rotation == []
    assert (stats.adapter_queue_other, stats.adapters_queued) == (0, 0)
