"""AdapterWeights: a LoRA adapter's A and B matrices per base-model module, scaling folded into B."""

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from torch import Tensor

from adapters.errors import AdapterInvalid
from adapters.spec import WEIGHTS_FILE, AdapterSpec

# PEFT saves "base_model.model.<module path>.lora_A.weight"; the adapter name ("default") appears in
# unprocessed state dicts. "base_model.model." is PeftModel's wrapper around the base model.
_LORA_KEY = re.compile(r"(?:base_model\.model\.)?(?P<path>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight")
# Tensors that PEFT saves for training-only LoRA variants; the eval forward pass does not read them.
_TRAINING_ONLY_KEY = re.compile(r".+\.(lora_velora_embed|lora_monteclora_sampler\..+)")


@dataclass  # not frozen: the engine swaps in pinned copies of a and b
class LoRAModuleWeights:
    a: Tensor  # [r, in]
    b: Tensor  # [out, r], scaling already folded in

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])

    @property
    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()


@dataclass(frozen=True)
class AdapterWeights:
    spec: AdapterSpec
    modules: dict[str, LoRAModuleWeights] = field(default_factory=dict)  # keyed by base-model module path
    # The engine's page-shaped copy sources by page rank (views of a and b, padded last pages), prepared
    # where the adapter is read so that a load on the engine's thread is one copy call.
    page_sources: dict[int, object] = field(default_factory=dict, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.modules.values())

    @property
    def rank(self) -> int:
        """Largest rank among the modules present: what a padded engine slot must hold."""
        return max((m.rank for m in self.modules.values()), default=0)


def parse_lora_key(key: str) -> tuple[str, str] | None:
    """("model.layers.0.self_attn.q_proj", "A") for a PEFT LoRA tensor key; None for anything else."""
    match = _LORA_KEY.fullmatch(key)
    return (match["path"], match["which"]) if match else None


def is_training_only_key(key: str) -> bool:
    return _TRAINING_ONLY_KEY.fullmatch(key) is not None


def load_adapter_weights(
    path: Path, spec: AdapterSpec, *, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> AdapterWeights:
    """Read `adapter_model.safetensors` (never a pickle) and fold `spec.scaling_for(module)` into each B.

    Expects a validated adapter; still raises AdapterInvalid on keys or shapes the engine could not use.
    """
    if not (path / WEIGHTS_FILE).is_file():
        raise AdapterInvalid([f"missing {WEIGHTS_FILE}"])
    halves: dict[str, dict[str, Tensor]] = {}
    unexpected: list[str] = []
    # Read whole into memory, never mapped: a file truncated while it is read (replaced in place) would
    # otherwise end the whole engine process with SIGBUS. Adapter files are bounded at upload.
    tensors = load_safetensors((path / WEIGHTS_FILE).read_bytes())
    for key, tensor in tensors.items():
        parsed = parse_lora_key(key)
        if parsed is None:
            if not is_training_only_key(key):
                unexpected.append(key)
            continue
        module_path, which = parsed
        halves.setdefault(module_path, {})[which] = tensor
    problems = [f"unexpected tensor {key}" for key in unexpected]
    modules: dict[str, LoRAModuleWeights] = {}
    for module_path, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            problems.append(f"module {module_path} has no {missing}")
            continue
        a, b = pair["A"], pair["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            problems.append(
                f"module {module_path}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not chain"
            )
            continue
        # Fold in float32 so that fp16/bf16 adapters lose precision once, at the final cast.
        served_a = a.to(dtype, copy=True)
        served_b = (b.to(torch.float32) * spec.scaling_for(module_path)).to(dtype)
        # Checked as served, on the CPU: finite weights times a huge alpha/r can overflow in fp16/bf16.
        if not (torch.isfinite(served_a).all() and torch.isfinite(served_b).all()):
            problems.append(f"module {module_path} has NaN or Inf weights once scaled and cast to {dtype}")
            continue
        modules[module_path] = LoRAModuleWeights(
            a=served_a.to(device=device).contiguous(), b=served_b.to(device=device).contiguous()
        )
    if problems:
        raise AdapterInvalid(problems)
    return AdapterWeights(spec=spec, modules=modules)
