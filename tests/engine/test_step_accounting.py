"""Each engine step's measured device time is split across its sequences in proportion to the tokens each
processed in it, so a long prefill chunk carries most of a mixed step and a decode a token's worth."""

import json
from typing import Any

import pytest
import torch

from deployments.engine.interface import EngineRequest, SamplingParams, StructuredOutput
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.model.kv_cache import KVCache
from tests.engine.helpers import make_engine
from tests.model_fixtures import TinySetup

DECODING = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)


def test_a_mixed_step_is_billed_by_tokens_processed(llama: TinySetup) -> None:
    engine = make_engine(llama, max_num_batched_tokens=128, num_kv_blocks=256, block_size=4)
    decodes = [f"d{i}" for i in range(4)]
    for i, rid in enumerate(decodes):
        engine.add_request(EngineRequest(rid, [1 + i, 2, 3], DECODING))
    engine.step()  # their prompts: from now on each decodes one token per step
    engine.add_request(EngineRequest("prefill", list(range(10, 110)), SamplingParams(max_tokens=4)))
    seqs = {rid: engine.group(rid)[0] for rid in [*decodes, "prefill"]}
    before = {rid: seq.metrics.gpu_time for rid, seq in seqs.items()}
    busy = engine.counters.busy_seconds

    engine.step()  # one step: four 1-token decodes beside the 100-token prefill chunk

    elapsed = engine.counters.busy_seconds - busy
    assert elapsed > 0 and seqs["prefill"].num_computed == 100
    share = {rid: seq.metrics.gpu_time - before[rid] for rid, seq in seqs.items()}
    assert sum(share.values()) == pytest.approx(elapsed, rel=1e-9)
    assert share["prefill"] == pytest.approx(elapsed * 100 / 104, rel=1e-9)
    for rid in decodes:
        assert share[rid] == pytest.approx(elapsed / 104, rel=1e-9)


def test_host_work_one_request_causes_is_charged_to_it_alone(
    llama: TinySetup, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A structured-output row's grammar mask and closing are its own: the plain decode rows beside it are
    # charged only their token share of the rest, and the charges still sum to the step's busy time.
    engine = make_engine(llama, num_kv_blocks=256)
    schema = {"type": "object", "properties": {"note": {"type": "string", "format": "email"}}}
    spec = StructuredOutput(json.dumps(schema))
    engine.add_request(EngineRequest("grammar", [4, 5, 6], SamplingParams(max_tokens=40, structured=spec)))
    for i in range(3):
        engine.add_request(EngineRequest(f"plain{i}", [7 + i, 8, 9], DECODING))
    engine.step()  # the prompts; every row decodes one token per step from now on
    seqs = {rid: engine.group(rid)[0] for rid in ["grammar", "plain0", "plain1", "plain2"]}
    own: dict[str, float] = {}
    account = LLMEngine._account

    def spied(self: LLMEngine, scheduled: Any, elapsed: float) -> None:
        own.update({s.seq.request_id: s.seq.metrics.step_host_time for s in scheduled})
        account(self, scheduled, elapsed)

    monkeypatch.setattr(LLMEngine, "_account", spied)
    before = {rid: seq.metrics.gpu_time for rid, seq in seqs.items()}
    busy = engine.counters.busy_seconds
    engine.step()
    elapsed = engine.counters.busy_seconds - busy
    share = {rid: seq.metrics.gpu_time - before[rid] for rid, seq in seqs.items()}
    assert own["grammar"] > 0 and all(own[f"plain{i}"] == 0 for i in range(3))
    assert sum(share.values()) == pytest.approx(elapsed, rel=1e-9)
    shared = elapsed - own["grammar"]
    assert share["grammar"] == pytest.approx(shared / 4 + own["grammar"], rel=1e-9)
    for i in range(3):
        assert share[f"plain{i}"] == pytest.approx(shared / 4, rel=1e-9)
    assert all(seq.metrics.step_host_time == 0 for seq in seqs.values())  # reset for the next step


def test_kv_blocks_for_a_memory_budget() -> None:
    shape = {"num_layers": 2, "block_size": 16, "num_kv_heads": 4, "head_dim": 64}
    per_block = 2 * 2 * 16 * 4 * 64  # K and V, every layer, elements
    # One block of the budget is the cache's sink (the K/V writes of padded decode rows).
    assert KVCache.blocks_for_budget(2**20, dtype=torch.float32, **shape) == 2**20 // (per_block * 4) - 1
    assert KVCache.blocks_for_budget(2**20, dtype=torch.bfloat16, **shape) == 2**20 // (per_block * 2) - 1
    assert KVCache.blocks_for_budget(10, dtype=torch.float32, **shape) == 2  # never fewer than two


def test_an_engine_sized_by_memory_stays_within_it(llama: TinySetup) -> None:
    engine = make_engine(llama, num_kv_blocks=None, kv_cache_memory_mb=3)
    assert engine.kv_cache.nbytes <= 3 * 2**20  # the sink block included
    per_block = engine.kv_cache.nbytes // (engine.kv_cache.num_blocks + 1)
    assert engine.kv_cache.nbytes + per_block > 3 * 2**20  # and uses it: one block more would not fit
