"""Adapter churn never changes another request's tokens (issue 34, item 4).

vLLM once let an adapter loaded out of band evict a device slot while requests decoded on it: they went on,
silently, with another adapter's weights (vllm#47724). Here each kind of churn that reaches the engine's
adapter tiers from outside the request path (pins and unpins, an adapter dropped from memory by hand or by
the registry watcher's reconcile, with or without its files in the store, a new version uploaded and
pinned) is applied to the real LLMEngine between `step()` calls, where requests are checked to be mid-decode.
Every request's greedy output must then equal, token for token, the same request run on a fresh engine
without churn, one slot per adapter (nothing is evicted there). A request whose adapter is gone for good
may fail cleanly instead (finish_reason ERROR, AdapterNotFound, what it streamed a prefix of its clean
output): it never goes on with other weights. After every step, each running request's slot must also hold
its own adapter, with the very weights that adapter had in a slot before: an overwrite shows at once, even
where it would not flip a greedy token.

Several adapters and the base model decode together, on fewer device slots than adapters, and they share
one prompt: a request that went on with another adapter's weights (or the base model's) would produce that
one's tokens, so each test first checks that those differ, which keeps it from passing by accident. The
time-based bounds (adapter_wait_bound_s, fair_wait_bound_s) are off and adapters are in CPU memory before
they are needed, so the schedule, and where the churn lands, is the same on every machine.
"""

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapters.errors import AdapterNotFound
from adapters.ref import AdapterRef
from adapters.spec import WEIGHTS_FILE
from adapters.store import AdapterStore
from deployments.engine.interface import EngineRequest, FinishReason
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.outputs import RequestOutput
from deployments.engine.sampling_params import SamplingParams
from deployments.engine.sequence import Sequence
from tests.engine.helpers import copy_adapter, drain, make_engine, preload, tokens
from tests.model_fixtures import TinySetup

PROMPT = list(range(40, 60))  # one prompt for everyone: only the weights tell the outputs apart
# Fewer slots than adapters, and no time-based preemption: the schedule depends on the steps alone.
# Three adapters of any rank fit at once (one page each), so the scenarios below know who waits for a slot.
CHURN: dict[str, Any] = {
    "max_loras": 3,
    "lora_page_rank": 16,
    "adapter_wait_bound_s": 0.0,
    "fair_wait_bound_s": 0.0,
}


@dataclasses.dataclass(frozen=True)
class Job:
    request_id: str
    adapter: AdapterRef | None  # None: the base model
    max_tokens: int = 32

    def request(self) -> EngineRequest:
        params = SamplingParams(max_tokens=self.max_tokens, temperature=0, ignore_eos=True)
        return EngineRequest(self.request_id, PROMPT, params, self.adapter)


@pytest.fixture
def setup(llama: TinySetup, tmp_path: Path) -> TinySetup:
    """The tiny llama over a store of its own (the demo adapters copied in), so that a test may delete
    from it and upload to it without touching the session's store."""
    store = AdapterStore(tmp_path / "store")
    refs = {name: store.put_dir(name, path) for name, path in llama.adapter_dirs.items()}
    return dataclasses.replace(llama, store_root=store.root, refs=refs)


def in_cpu_memory(engine: LLMEngine, *refs: AdapterRef) -> None:
    """Wait until each adapter is loaded into CPU memory (a load runs on the loader's threads)."""
    for ref in refs:
        future = engine.adapters.prefetch(ref)
        if future is not None:
            future.result()


def slot_weights(engine: LLMEngine, slot: int) -> list[torch.Tensor]:
    """What a device slot holds: its A and B in every LoRA module (views, not copies)."""
    return [t[slot] for m in engine.loaded.lora_modules.values() for t in (m.lora_a, m.lora_b)]


class ChurnRun:
    """One engine serving jobs step by step, outputs collected, for churn between the steps. After each
    step every running request's slot is checked to hold its adapter's weights."""

    def __init__(self, setup: TinySetup, jobs: Iterable[Job], **overrides: Any) -> None:
        self.engine = make_engine(setup, **{**CHURN, **overrides})
        preload(self.engine, setup)
        self.outputs: dict[str, list[RequestOutput]] = {}
        self._weights: dict[AdapterRef, list[torch.Tensor]] = {}  # each adapter's slot contents, first seen
        self.add(jobs)

    def add(self, jobs: Iterable[Job]) -> None:
        for job in jobs:
            if job.adapter is not None:
                in_cpu_memory(self.engine, job.adapter)
            self.engine.add_request(job.request())
            self.outputs[job.request_id] = []

    def step(self, steps: int = 1) -> None:
        for _ in range(steps):
            for out in self.engine.step():
                self.outputs[out.request_id].append(out)
            self._check_slots()

    def step_until(self, done: Callable[[], bool], max_steps: int = 100) -> None:
        for _ in range(max_steps):
            if done():
                return
            self.step()
        raise AssertionError("the awaited state never came")

    def running(self) -> dict[str, Sequence]:
        return {seq.group_id: seq for seq in self.engine.scheduler.running}

    def waiting(self) -> list[str]:
        return [seq.group_id for seq in self.engine.scheduler.waiting]

    def assert_decoding(self, *request_ids: str) -> None:
        """Each holds its KV blocks (and slot) and is part-way through its output."""
        running = self.running()
        for rid in request_ids:
            assert rid in running, f"{rid} is not running"
            seq = running[rid]
            assert 0 < seq.num_output_tokens < seq.max_tokens, f"{rid} is not mid-decode"

    def finish(self) -> dict[str, list[RequestOutput]]:
        """Drain, check that everything was given back, close; the outputs per request."""
        for rid, outs in drain(self.engine).items():
            self.outputs[rid].extend(outs)
        assert all(outs and outs[-1].finished for outs in self.outputs.values())
        slots = self.engine.adapters.slots
        assert all(slots.users(s) == 0 for s in range(slots.num_slots))
        assert self.engine.blocks.num_free_blocks == self.engine.blocks.num_blocks
        self.engine.close()
        return self.outputs

    def _check_slots(self) -> None:
        slots = self.engine.adapters.slots
        for seq in self.engine.scheduler.running:
            if seq.adapter is None:
                assert seq.slot < 0
                continue
            held = slots.ref_at(seq.slot)
            assert held == seq.adapter, f"{seq.group_id} ({seq.adapter}) decodes on a slot holding {held}"
            now = slot_weights(self.engine, seq.slot)
            before = self._weights.setdefault(seq.adapter, [t.clone() for t in now])
            assert all(torch.equal(a, b) for a, b in zip(before, now, strict=True)), (
                f"{seq.group_id}'s slot no longer holds the weights of {seq.adapter}"
            )


def clean_tokens(setup: TinySetup, jobs: Iterable[Job]) -> dict[str, list[int]]:
    """The jobs on a fresh engine without churn: one slot per adapter, all decoding at once."""
    jobs = list(jobs)
    engine = make_engine(setup, max_loras=len({j.adapter for j in jobs}), max_num_seqs=len(jobs))
    in_cpu_memory(engine, *{j.adapter for j in jobs if j.adapter is not None})
    for job in jobs:
        engine.add_request(job.request())
    outputs = drain(engine)
    assert engine.adapters.slots.evictions == 0
    engine.close()
    got = {rid: tokens(outs) for rid, outs in outputs.items()}
    assert all(len(got[j.request_id]) == j.max_tokens for j in jobs)
    return got


def assert_tell_apart(clean: dict[str, list[int]], jobs: Iterable[Job]) -> None:
    """Every adapter (and the base model) gives its own tokens here, within the shortest output, so a
    request that went on with other weights would show."""
    jobs = list(jobs)
    n = min(j.max_tokens for j in jobs)
    by_weights = {j.adapter: tuple(clean[j.request_id][:n]) for j in jobs}
    assert len(set(by_weights.values())) == len(by_weights), "two adapters give the same tokens"


def assert_same_tokens(outputs: dict[str, list[RequestOutput]], clean: dict[str, list[int]]) -> None:
    diverged = [rid for rid, want in clean.items() if tokens(outputs[rid]) != want]
    assert not diverged, f"churn changed the tokens of {diverged}"
    assert all(outputs[rid][-1].finish_reason is FinishReason.LENGTH for rid in clean)


def test_pins_and_unpins_while_requests_decode(setup: TinySetup) -> None:
    """An adapter pinned out of band while every slot is busy waits for a slot to free (never takes a busy
    one), then serves a request that arrives for it; it is unpinned while that request decodes, and pins
    move to adapters that are decoding. Nobody's tokens change."""
    r = setup.refs
    jobs = [
        Job("base", None, 40),
        Job("sql", r["demo-sql"], 24),
        Job("poet", r["demo-poet"], 40),
        Job("pirate", r["demo-pirate"], 32),
        Job("legal", r["demo-legal"], 28),  # a fourth adapter on three slots: waits for one
    ]
    late = Job("chef", r["demo-chef"], 24)
    clean = clean_tokens(setup, [*jobs, late])
    assert_tell_apart(clean, [*jobs, late])

    run = ChurnRun(setup, jobs)
    adapters, slots = run.engine.adapters, run.engine.adapters.slots
    run.step(3)
    run.assert_decoding("base", "sql", "poet", "pirate")
    assert run.waiting() == ["legal"] and slots.num_free == 0
    adapters.pin(r["demo-chef"])
    run.step_until(lambda: slots.holds(r["demo-chef"]))  # the first slot to free: sql's, once it finished
    assert run.outputs["sql"][-1].finished
    run.assert_decoding("base", "poet", "pirate")
    run.add([late])
    run.step_until(lambda: bool(tokens(run.outputs["chef"])))
    adapters.unpin(r["demo-chef"])  # while its request decodes on it
    adapters.pin(r["demo-poet"])  # where it decodes
    run.step(3)
    run.assert_decoding("chef", "poet")
    adapters.unpin(r["demo-poet"])
    run.step_until(lambda: "legal" in run.running())
    adapters.pin(r["demo-legal"])  # as soon as it decodes, to the end
    run.step(2)
    run.assert_decoding("base", "poet", "chef", "legal")
    outputs = run.finish()

    assert slots.evictions >= 2, "adapters were meant to move through the slots"
    assert_same_tokens(outputs, clean)


def test_an_adapter_dropped_from_memory_while_its_requests_decode(setup: TinySetup) -> None:
    """`adapters.remove` (AsyncEngine.remove_adapter) drops two adapters from the slots and CPU memory while
    their requests decode; their files stay in the store. sql's request finishes on its slot, which drains.
    poet's is then preempted for KV blocks: its slot goes with its last user, and it resumes on the weights
    read again from the store. Nobody's tokens change."""
    r = setup.refs
    jobs = [
        Job("base", None),
        Job("sql", r["demo-sql"]),
        Job("pirate", r["demo-pirate"]),
        Job("poet", r["demo-poet"]),  # admitted last: the one preempted when KV blocks run out
    ]
    cold = Job("legal", r["demo-legal"], 24)
    clean = clean_tokens(setup, [*jobs, cold])
    assert_tell_apart(clean, [*jobs, cold])

    run = ChurnRun(setup, jobs, num_kv_blocks=44)  # 4 x 13 blocks wanted in the end: one is preempted
    adapters = run.engine.adapters
    run.step(6)
    run.assert_decoding("base", "sql", "pirate", "poet")
    poet = run.running()["poet"]
    adapters.remove("demo-poet")
    adapters.remove("demo-sql")
    assert not {r["demo-poet"], r["demo-sql"]} & set(adapters.cpu.resident())
    run.add([cold])  # wants a slot now: it must wait for a drained one, not take a removed one in use
    run.step_until(lambda: poet.metrics.num_preemptions > 0)
    run.assert_decoding("base", "sql", "pirate")
    outputs = run.finish()

    assert adapters.disk_loads[str(r["demo-poet"])] == 2, "poet was meant to be read again from the store"
    assert not adapters.slots.holds(r["demo-sql"])  # its slot was freed with its last user
    assert_same_tokens(outputs, clean)


def test_an_adapter_deleted_from_the_registry_while_its_requests_decode(setup: TinySetup) -> None:
    """Its owner deletes an adapter (its files leave the store) and the registry watcher's reconcile drops
    it while three of its requests are in flight. gone-a decodes to the end on its slot, with the tokens it
    would have had. gone-b is preempted for KV blocks after the deletion: its weights went with the adapter,
    so it fails cleanly (AdapterNotFound) with a prefix of its clean output, or, should the engine keep them
    for it, finishes with that output; never with other weights. gone-c, still queued, fails without a
    token. The other requests are untouched."""
    store = AdapterStore(setup.store_root)
    gone = store.put_dir("churn-gone", setup.adapter_dirs["demo-legal"])
    r = setup.refs
    jobs = [
        Job("base", None),
        Job("sql", r["demo-sql"]),
        Job("gone-a", gone),
        Job("gone-b", gone),  # admitted last: the one preempted when KV blocks run out
        Job("gone-c", gone, 24),  # queued: four rows
    ]
    clean = clean_tokens(setup, jobs)
    assert_tell_apart(clean, jobs)

    run = ChurnRun(setup, jobs, num_kv_blocks=44, max_num_seqs=4)
    adapters = run.engine.adapters
    run.step(6)
    run.assert_decoding("base", "sql", "gone-a", "gone-b")
    assert run.waiting() == ["gone-c"]
    gone_b = run.running()["gone-b"]
    store.delete("churn-gone")
    adapters.reconcile(live=set(r), pinned=set(), prefetch=[])
    assert gone not in adapters.cpu.resident()
    run.step_until(lambda: gone_b.metrics.num_preemptions > 0)
    run.assert_decoding("base", "sql", "gone-a")
    outputs = run.finish()

    assert_same_tokens(outputs, {rid: clean[rid] for rid in ("base", "sql", "gone-a")})
    b, c = outputs["gone-b"][-1], outputs["gone-c"][-1]
    got_b = tokens(outputs["gone-b"])
    if b.finish_reason is FinishReason.ERROR:
        assert isinstance(b.error, AdapterNotFound)
        assert 0 < len(got_b) < len(clean["gone-b"]) and got_b == clean["gone-b"][: len(got_b)]
    else:
        assert got_b == clean["gone-b"]
    assert c.finish_reason is FinishReason.ERROR and isinstance(c.error, AdapterNotFound)
    assert not tokens(outputs["gone-c"])
    assert not adapters.slots.holds(gone)


def other_weights(src: Path, dst: Path) -> Path:
    """A copy of the adapter at `src` with every B negated: same config, other outputs."""
    copy_adapter(src, dst)
    weights = load_file(dst / WEIGHTS_FILE)
    save_file({k: -t if ".lora_B." in k else t for k, t in weights.items()}, dst / WEIGHTS_FILE)
    return dst


def test_a_new_version_uploaded_while_the_old_one_decodes(setup: TinySetup, tmp_path: Path) -> None:
    """A pinned adapter gets a new version while two requests decode on the old one: the watcher's pass
    pins the new version and releases the old pin. The old version's requests, and one more routed to it
    before the upload, finish on the old weights; a new request gets the new version (same prompt, no
    prefix reused across versions). Each equals a run of its own version without churn."""
    store = AdapterStore(setup.store_root)
    v1 = store.put_dir("churn-ver", setup.adapter_dirs["demo-sql"])
    v2_dir = other_weights(setup.adapter_dirs["demo-sql"], tmp_path / "v2")
    live = {*setup.refs, "churn-ver"}
    r = setup.refs
    jobs = [
        Job("base", None, 36),
        Job("poet", r["demo-poet"], 28),
        Job("pirate", r["demo-pirate"], 32),
        Job("v1-a", v1, 32),
        Job("v1-b", v1, 40),
    ]

    run = ChurnRun(setup, jobs)
    adapters, slots = run.engine.adapters, run.engine.adapters.slots
    adapters.reconcile(live=live, pinned={v1}, prefetch=[])
    run.step(6)
    run.assert_decoding("base", "poet", "pirate", "v1-a", "v1-b")
    v2 = store.put_dir("churn-ver", v2_dir)
    assert v2 == AdapterRef("churn-ver", v1.version + 1)
    adapters.reconcile(live=live, pinned={v2}, prefetch=[])
    assert slots.pinned == {v2}
    late = [Job("v2-a", v2, 24), Job("v1-late", v1, 24)]
    run.add(late)
    run.step_until(lambda: "v2-a" in run.running())  # v2 waits for a slot to free: poet's
    run.assert_decoding("base", "pirate", "v1-a", "v1-b", "v1-late", "v2-a")
    outputs = run.finish()

    clean = clean_tokens(setup, [*jobs, *late])  # both versions are in the store by now
    assert_tell_apart(clean, [*jobs, *late])
    assert_same_tokens(outputs, clean)
    usage = {rid: outs[-1].usage for rid, outs in outputs.items()}
    assert usage["v1-late"] is not None and usage["v1-late"].cached_prompt_tokens > 0  # v1's own prefix
    assert usage["v2-a"] is not None and usage["v2-a"].cached_prompt_tokens == 0  # not v1's
