"""Demo LoRA adapters in PEFT format, made by PEFT itself from a base model directory, deterministically.

The random A and B are rescaled per module so that the update `scaling * B @ A` has a fixed fraction of the
base weight's norm: large enough that greedy outputs visibly change, small enough to stay coherent.

CLI: `python -m adapters.demo_adapters BASE_DIR OUT_ROOT`.
"""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

# ||scaling * B @ A|| / ||W|| (Frobenius) in every adapted module: well above 4-bit quantization error (~0.1),
# yet the model stays coherent.
DELTA_TO_WEIGHT_NORM = 0.25


class DemoAdapter(BaseModel):
    """Recipe for one demo adapter."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Adapter id, also the output directory name.")
    r: int = Field(gt=0, description="LoRA rank.")
    lora_alpha: float = Field(gt=0, description="LoRA alpha.")
    target_modules: tuple[str, ...] = Field(description="Module suffix names to adapt.")
    use_rslora: bool = Field(default=False, description="Rank-stabilised scaling alpha/sqrt(r).")
    rank_pattern: dict[str, int] | None = Field(
        default=None, description="Per-module rank overrides (PEFT keys)."
    )
    seed: int = Field(description="Seed for the random A and B.")


# Phi-3's fused linears, by the separate ones they replace.
_FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")

DEMO_ADAPTERS: tuple[DemoAdapter, ...] = (
    DemoAdapter(name="demo-sql", r=8, lora_alpha=16, target_modules=_ATTENTION, seed=101),
    DemoAdapter(name="demo-poet", r=16, lora_alpha=16, target_modules=_MLP, seed=102),
    DemoAdapter(name="demo-pirate", r=4, lora_alpha=8, target_modules=_ATTENTION + _MLP, seed=103),
    DemoAdapter(
        name="demo-legal", r=8, lora_alpha=8, target_modules=("q_proj", "v_proj"), use_rslora=True, seed=104
    ),
    DemoAdapter(
        name="demo-chef",
        r=8,
        lora_alpha=16,
        target_modules=("q_proj", "v_proj", "down_proj"),
        rank_pattern={"down_proj": 16, "layers.0.self_attn.q_proj": 4},
        seed=105,
    ),
)


def build_demo_adapter(
    base_model_dir: Path,
    out_dir: Path,
    *,
    r: int,
    lora_alpha: float,
    target_modules: Sequence[str],
    use_rslora: bool = False,
    seed: int,
    rank_pattern: dict[str, int] | None = None,
) -> Path:
    """Wrap the base model with PEFT (random A and B), rescale B, `save_pretrained` into `out_dir`.

    On a base with fused linears (Phi-3's qkv_proj, gate_up_proj) a recipe's q/k/v or gate/up targets name
    the fused linear instead, the only one PEFT can adapt there."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
    names = {path.rsplit(".", 1)[-1] for path, _ in base.named_modules()}
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,  # type: ignore[arg-type]  # PEFT annotates int; it stores any number
        target_modules=list(dict.fromkeys(_on_base(name, names) for name in target_modules)),
        use_rslora=use_rslora,
        rank_pattern={_on_base(key, names): rank for key, rank in (rank_pattern or {}).items()},
        init_lora_weights=False,  # random B too: a fresh adapter must change outputs
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):  # seeded without touching global RNG
        torch.manual_seed(seed)
        model = get_peft_model(base, config)
        _rescale_updates(model)
        model.save_pretrained(str(out_dir))
    return out_dir


def _on_base(name: str, module_names: set[str]) -> str:
    """`name` (a module suffix or a pattern ending in one), with q/k/v or gate/up renamed to the base's fused
    linear where the base has no separate one."""
    head, _, suffix = name.rpartition(".")
    fused = _FUSED.get(suffix)
    if suffix in module_names or fused is None or fused not in module_names:
        return name
    return f"{head}.{fused}" if head else fused


def build_demo_adapters(base_model_dir: Path, out_root: Path) -> dict[str, Path]:
    """Build every adapter of DEMO_ADAPTERS into `out_root/<name>`."""
    built: dict[str, Path] = {}
    for demo in DEMO_ADAPTERS:
        built[demo.name] = build_from_recipe(demo, base_model_dir, out_root / demo.name)
    return built


def build_from_recipe(demo: DemoAdapter, base_model_dir: Path, out_dir: Path) -> Path:
    """One DEMO_ADAPTERS entry, built into `out_dir`."""
    return build_demo_adapter(
        base_model_dir,
        out_dir,
        r=demo.r,
        lora_alpha=demo.lora_alpha,
        target_modules=demo.target_modules,
        use_rslora=demo.use_rslora,
        seed=demo.seed,
        rank_pattern=demo.rank_pattern,
    )


@torch.no_grad()
def _rescale_updates(model: torch.nn.Module) -> None:
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        weight_norm = _weight(module.get_base_layer()).float().norm()
        for adapter, scaling in module.scaling.items():
            lora_a, lora_b = _weight(module.lora_A[adapter]), _weight(module.lora_B[adapter])
            update_norm = ((lora_b @ lora_a).float() * scaling).norm()
            lora_b.mul_((DELTA_TO_WEIGHT_NORM * weight_norm / update_norm).to(lora_b.dtype))


def _weight(module: torch.nn.Module) -> torch.Tensor:
    weight = module.weight
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise TypeError(f"{type(module).__name__} has no floating-point weight (a quantized base model?)")
    return weight


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the demo LoRA adapters for a base model directory.")
    parser.add_argument("base_dir", type=Path, help="HF model directory (config.json + safetensors weights)")
    parser.add_argument("out_root", type=Path, help="one sub-directory per adapter is written here")
    args = parser.parse_args(argv)
    for name, path in build_demo_adapters(args.base_dir, args.out_root).items():
        print(f"{name}\t{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
