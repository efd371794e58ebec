"""What the engine decides for itself at load: the compute dtype from the CPU, the adapter pages from memory,
and how many adapters of which ranks that memory holds."""

import logging

import pytest
import torch

import deployments.engine.config as config_module
from deployments.engine.config import EngineConfig
from deployments.engine.cpu_features import CpuFeatures
from deployments.engine.interface import EngineRequest
from deployments.engine.sampling_params import SamplingParams
from tests.engine.helpers import drain, make_engine, preload
from tests.model_fixtures import TinySetup

AVX2 = CpuFeatures("AMD EPYC", 2, frozenset({"avx2", "fma"}))
AMX = CpuFeatures("Xeon", 2, frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}))


@pytest.mark.parametrize(
    ("cpu", "dtype", "why"),
    [(AVX2, torch.float32, "no native bf16 (avx2)"), (AMX, torch.bfloat16, "native bf16 (avx2, avx512f")],
)
def test_auto_dtype_follows_the_cpu(
    cpu: CpuFeatures, dtype: torch.dtype, why: str, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setattr(config_module, "cpu_features", lambda: cpu)
    config = EngineConfig(model=tmp_path, adapter_store=tmp_path, device="cpu")
    chosen, reason = config.dtype_choice()
    assert chosen == dtype and why in reason
    assert EngineConfig(
        model=tmp_path, adapter_store=tmp_path, device="cpu", dtype="float32"
    ).torch_dtype() == (torch.float32)


def test_unset_max_loras_sizes_the_adapter_pages_from_lora_memory_mb(
    llama: TinySetup, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    engine = make_engine(llama, max_loras=None, lora_memory_mb=1)
    modules = engine.loaded.lora_modules.values()
    per_page = sum(16 * (m.in_features + m.out_features) for m in modules) * 4  # pages of rank 16, fp32
    assert engine.loaded.lora_page_rank == 16
    assert engine.loaded.lora_pages == engine.adapters.slots.num_slots == 2**20 // per_page
    assert engine.loaded.lora_slot_bytes == per_page * engine.loaded.lora_pages
    assert "compute dtype torch.float32 (set in the config)" in caplog.text
    engine.close()
    big = make_engine(llama, max_loras=None, lora_memory_mb=100_000)
    assert big.adapters.slots.num_slots == 256  # capped: 256 adapters of max_lora_rank 16
    big.close()
    two = make_engine(llama, max_loras=2, lora_page_rank=4)  # the memory of two adapters of max_lora_rank
    assert two.adapters.slots.num_slots == 8
    two.close()


@pytest.mark.parametrize(("page_rank", "all_resident"), [(4, True), (16, False)])
def test_adapter_memory_holds_the_sum_of_the_ranks(
    llama: TinySetup, page_rank: int, all_resident: bool
) -> None:
    """The memory of four rank-16 adapters (max_loras 4) holds the five demo adapters (ranks 8, 16, 4, 8 and
    16 at most: 52 rank units) in pages of 4, with nothing evicted; in slots of 16 it holds four of them."""
    engine = make_engine(llama, max_loras=4, lora_page_rank=page_rank)
    preload(engine, llama)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for name, ref in llama.refs.items():
        engine.add_request(EngineRequest(name, [11, 12, 13], params, ref))
        drain(engine)  # one after another: nothing busy, so a claim may evict anything idle
    ranks = engine.stats().resident_ranks
    assert (engine.adapters.slots.evictions == 0) is all_resident
    if all_resident:
        assert set(ranks) == {str(ref) for ref in llama.refs.values()}
        assert sorted(ranks.values()) == [4, 8, 8, 16, 16]
        slots = engine.adapters.slots
        assert sum(map(slots.pages_at, slots.resident().values())) == 13  # 2 + 4 + 1 + 2 + 4 pages
    else:
        assert len(ranks) == 4
    engine.close()
