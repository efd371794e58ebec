"""A tiny random Llama and PEFT-made adapters for it, plus helpers to tamper with adapter files."""

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from adapters.layout import BaseModelLayout
from adapters.spec import CONFIG_FILE, WEIGHTS_FILE

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MakeAdapter = Callable[..., Path]


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    )


@pytest.fixture(scope="session")
def base_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("base")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(tiny_llama_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def layout(base_model_dir: Path) -> BaseModelLayout:
    return BaseModelLayout.from_model_dir(base_model_dir)


def peft_model(base_model_dir: Path, *, seed: int = 0, **lora_kwargs: Any) -> PeftModel:
    """The base model wrapped by PEFT with random (non-zero) A and B."""
    lora_kwargs.setdefault("target_modules", ALL_SEVEN)
    config = LoraConfig(init_lora_weights=False, task_type="CAUSAL_LM", **lora_kwargs)
    base = LlamaForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(base, config)
    return model.eval()


@pytest.fixture(scope="session")
def make_adapter(base_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> MakeAdapter:
    """make_adapter(**LoraConfig kwargs) -> a fresh directory holding a PEFT-saved adapter."""

    def make(*, seed: int = 0, **lora_kwargs: Any) -> Path:
        out = tmp_path_factory.mktemp("adapter")
        peft_model(base_model_dir, seed=seed, **lora_kwargs).save_pretrained(str(out))
        return out

    return make


@pytest.fixture(scope="session")
def good_adapter(make_adapter: MakeAdapter) -> Path:
    return make_adapter(r=4, lora_alpha=8)


@pytest.fixture
def adapter_copy(good_adapter: Path, tmp_path: Path) -> Path:
    """A private copy of good_adapter, free to tamper with."""
    return Path(shutil.copytree(good_adapter, tmp_path / "adapter"))


def edit_config(adapter_dir: Path, **changes: Any) -> None:
    path = adapter_dir / CONFIG_FILE
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def edit_tensors(adapter_dir: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    path = adapter_dir / WEIGHTS_FILE
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def lora_key(module_path: str, which: str) -> str:
    return f"base_model.model.{module_path}.lora_{which}.weight"
