"""Each engine step's measured device time is split across its sequences in proportion to the tokens each
processed in it, so a long prefill chunk carries most of a mixed step and a decode a token's worth."""

import pytest
import torch

from deployments.engine.interface import EngineRequest, SamplingParams
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
