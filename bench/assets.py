"""Benchmark assets, built once and cached: a ~150M Llama-shaped model and N rank-r adapters on all linears.

Adapters are made with PEFT itself (one wrapped model, re-randomised per adapter), so they are real PEFT
directories; building them through `build_demo_adapter` would reload the 600 MB base model 16 times.
"""

import json
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from adapters.store import AdapterStore
from app.modelprep.demo_model import Arch, ensure_model
from deployments.engine.config import DEFAULT_LORA_TARGETS

BENCH_DIR = Path("var/bench")


def lora_targets(model: torch.nn.Module) -> list[str]:
    """The default LoRA targets this model has (a Llama's seven linears; never Phi-3's fused names, which
    an upload for a base without them would be refused for)."""
    names = {path.rsplit(".", 1)[-1] for path, _ in model.named_modules()}
    return [t for t in DEFAULT_LORA_TARGETS if t in names]


def ensure_bench_assets(
    *,
    preset: str = "bench-150m",
    num_adapters: int = 16,
    rank: int = 16,
    root: Path = BENCH_DIR,
    arch: Arch = "llama",
) -> tuple[Path, Path, dict[str, Path]]:
    """(model_dir, store_root, adapter name -> PEFT dir); reuses what an earlier run built. Llama's keep
    the preset's bare name; another architecture's names carry it."""
    stem = preset if arch == "llama" else f"{preset}-{arch}"
    model_dir = ensure_model(root / stem, arch=arch, preset=preset)
    adapter_root = root / f"{stem}-adapters-r{rank}"
    names = [f"bench-{i:02d}" for i in range(num_adapters)]
    dirs = {name: adapter_root / name for name in names}
    missing = [n for n in names if not (dirs[n] / "adapter_model.safetensors").exists()]
    if missing:
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=lora_targets(base))
        model = get_peft_model(base, config)
        for name in missing:
            generator = torch.Generator().manual_seed(int(name.split("-")[1]))
            with torch.no_grad():
                for pname, param in model.named_parameters():
                    if "lora_A" in pname or "lora_B" in pname:
                        param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
            model.save_pretrained(str(dirs[name]))
    store_root = root / f"{stem}-store-r{rank}"
    store = AdapterStore(store_root)
    for name, path in dirs.items():
        if not store.versions(name):
            store.put_dir(name, path)
    (root / "README.json").write_text(json.dumps({"note": "benchmark cache; safe to delete"}))
    return model_dir, store_root, dirs


def ensure_mixed_adapters(
    *, preset: str, ranks: list[int], root: Path = BENCH_DIR
) -> tuple[Path, Path, list[str]]:
    """(model_dir, store_root, names): adapter i has rank ranks[i], all seven linear targets, PEFT-made.

    One PEFT wrapper per distinct rank, re-randomised per adapter; a store shared by every run that asks
    for a prefix of the same rank list (names carry their rank, so a different list builds new ones)."""
    model_dir = ensure_model(root / preset, arch="llama", preset=preset)
    adapter_root = root / f"{preset}-adapters-mixed"
    names = [f"mt-{i:03d}-r{rank}" for i, rank in enumerate(ranks)]
    missing = [(n, r) for n, r in zip(names, ranks, strict=True) if not (adapter_root / n).is_dir()]
    for rank in sorted({r for _, r in missing}):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=lora_targets(base))
        model = get_peft_model(base, config)
        for name in [n for n, r in missing if r == rank]:
            generator = torch.Generator().manual_seed(int(name.split("-")[1]))
            with torch.no_grad():
                for pname, param in model.named_parameters():
                    if "lora_A" in pname or "lora_B" in pname:
                        param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
            target = adapter_root / name
            model.save_pretrained(str(target.with_name(name + ".tmp")))
            target.with_name(name + ".tmp").rename(target)  # a killed build leaves no half adapter
    store_root = root / f"{preset}-store-mixed"
    store = AdapterStore(store_root)
    for name in names:
        if not store.versions(name):
            store.put_dir(name, adapter_root / name)
    return model_dir, store_root, names
