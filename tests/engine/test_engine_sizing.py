"""What the engine decides for itself at load: the compute dtype from the CPU, the slot count from memory."""

import logging

import pytest
import torch

import deployments.engine.config as config_module
from deployments.engine.config import EngineConfig
from deployments.engine.cpu_features import CpuFeatures
from tests.engine.helpers import make_engine
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


def test_unset_max_loras_sizes_the_slots_from_lora_memory_mb(
    llama: TinySetup, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    engine = make_engine(llama, max_loras=None, lora_memory_mb=1)
    modules = engine.loaded.lora_modules.values()
    per_slot = sum(16 * (m.in_features + m.out_features) for m in modules) * 4  # rank 16, fp32
    assert engine.loaded.max_loras == engine.adapters.slots.num_slots == 2**20 // per_slot
    assert engine.loaded.lora_slot_bytes == per_slot * engine.loaded.max_loras
    assert "compute dtype torch.float32 (set in the config)" in caplog.text
    engine.close()
    big = make_engine(llama, max_loras=None, lora_memory_mb=100_000)
    assert big.adapters.slots.num_slots == 256  # capped
    big.close()
