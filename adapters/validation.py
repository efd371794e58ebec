"""validate_adapter_dir: everything that must hold before an adapter may be served, every problem reported.

Tensors are read one at a time through `safe_open`, so validating never holds the whole adapter in memory.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open

from adapters.errors import AdapterInvalid, AdapterRankTooLarge, UnsupportedAdapter
from adapters.layout import BaseModelLayout, module_suffix
from adapters.spec import (
    CONFIG_FILE,
    EMBEDDING_MODULES,
    WEIGHTS_FILE,
    AdapterSpec,
    check_adapter_config,
    read_adapter_config,
)
from adapters.weights import is_training_only_key, parse_lora_key

PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"})
SERVABLE_DTYPES = ("F32", "F16", "BF16")  # safetensors dtype names
# The narrowest dtype an engine may hold LoRA weights in: finite there is finite in bf16 and fp32 too.
SERVED_DTYPE = torch.float16
_SHOWN_KEYS = 5


class _TensorFile(Protocol):
    """The part of an open `safe_open` used here (safetensors leaves these methods untyped)."""

    def get_slice(self, name: str) -> Any: ...

    def get_tensor(self, name: str) -> torch.Tensor: ...


@dataclass
class _Findings:
    invalid: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)
    rank: int = 0  # largest rank declared or seen
    halves: dict[str, dict[str, int]] = field(default_factory=dict)  # module -> {"A"/"B": rank dimension}
    foreign: list[str] = field(default_factory=list)  # keys that are not LoRA A/B weights

    def raise_if_any(self, max_rank: int) -> None:
        too_large = self.rank > max_rank
        if not self.invalid and not self.unsupported:
            if too_large:
                raise AdapterRankTooLarge(self.rank, max_rank)
            return
        problems = [*self.invalid, *self.unsupported]
        if too_large:
            problems += AdapterRankTooLarge(self.rank, max_rank).problems
        if self.invalid or too_large:
            raise AdapterInvalid(problems)
        raise UnsupportedAdapter(problems)


def validate_adapter_dir(path: Path, layout: BaseModelLayout, *, max_rank: int) -> AdapterSpec:
    """Check an adapter directory against the base model; return its spec or raise listing every problem.

    Raises AdapterRankTooLarge when the rank is the only problem, UnsupportedAdapter when every problem is an
    unsupported option, AdapterInvalid otherwise.
    """
    if not path.is_dir():
        raise AdapterInvalid([f"adapter directory {path} does not exist"])
    found = _Findings()
    pickles = sorted(p.name for p in path.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        found.invalid.append(
            f"pickle-format files are refused and were not opened: {', '.join(pickles)}; "
            f"upload {WEIGHTS_FILE} instead"
        )
    spec = _check_config(path, layout, found)
    if (path / WEIGHTS_FILE).is_file():
        _check_tensors(path / WEIGHTS_FILE, layout, spec, found)
    else:
        found.invalid.append(f"missing {WEIGHTS_FILE}")
    found.raise_if_any(max_rank)
    if spec is None:  # unreachable: no spec means a config problem was recorded
        raise AdapterInvalid([f"{CONFIG_FILE} could not be parsed"])
    return spec


def _check_config(path: Path, layout: BaseModelLayout, found: _Findings) -> AdapterSpec | None:
    try:
        config = read_adapter_config(path)
    except AdapterInvalid as exc:
        found.invalid += exc.problems
        return None
    check = check_adapter_config(config, layout=layout)
    found.invalid += check.invalid
    found.unsupported += check.unsupported
    if check.spec is not None:
        found.rank = check.spec.max_rank
    return check.spec


def _check_tensors(file: Path, layout: BaseModelLayout, spec: AdapterSpec | None, found: _Findings) -> None:
    try:
        with safe_open(file, framework="pt", device="cpu") as tensors:
            for key in tensors.keys():  # noqa: SIM118 - safe_open is not a Mapping
                _check_tensor(tensors, key, layout, spec, found)
    except (SafetensorError, OSError) as exc:
        found.invalid.append(f"{WEIGHTS_FILE} is not a readable safetensors file: {exc}")
        return
    if found.foreign:
        # One line, not one per tensor: a DoRA adapter has a magnitude vector in every module.
        shown = ", ".join(found.foreign[:_SHOWN_KEYS])
        more = f" and {len(found.foreign) - _SHOWN_KEYS} more" if len(found.foreign) > _SHOWN_KEYS else ""
        count = len(found.foreign)
        found.unsupported.append(
            f"{count} tensors are not LoRA A/B weights (an unsupported PEFT option?): {shown}{more}"
        )
    if not found.halves:
        found.invalid.append(f"{WEIGHTS_FILE} holds no LoRA tensors (lora_A/lora_B weights)")
    for module_path, halves in sorted(found.halves.items()):
        if len(halves) == 1:
            has, lacks = ("lora_A", "lora_B") if "A" in halves else ("lora_B", "lora_A")
            found.invalid.append(f"module {module_path} has {has} but no {lacks}")
        elif spec is None and halves["A"] != halves["B"]:
            found.invalid.append(
                f"module {module_path}: lora_A rank {halves['A']} != lora_B rank {halves['B']}"
            )
        if spec is None:
            found.rank = max(found.rank, *halves.values())


def _check_tensor(
    tensors: _TensorFile, key: str, layout: BaseModelLayout, spec: AdapterSpec | None, found: _Findings
) -> None:
    parsed = parse_lora_key(key)
    if parsed is None:
        if not is_training_only_key(key):
            found.foreign.append(key)
        return
    module_path, which = parsed
    if module_suffix(module_path) in EMBEDDING_MODULES:
        found.unsupported.append(f"tensor {key} adapts the embedding/LM head {module_path}: not supported")
        return
    if module_path not in layout.modules:
        found.invalid.append(f"tensor {key}: {module_path} is not a servable linear layer of the base model")
        return
    if spec is not None and not spec.targets(module_path):
        found.invalid.append(f"tensor {key}: module {module_path} is not targeted by {CONFIG_FILE}")
    tensor_slice = tensors.get_slice(key)
    shape = list(tensor_slice.get_shape())
    _check_shape(module_path, which, shape, layout, spec, found)
    dtype = tensor_slice.get_dtype()
    if dtype not in SERVABLE_DTYPES:
        found.invalid.append(
            f"tensor {key} has dtype {dtype}; LoRA weights must be {'/'.join(SERVABLE_DTYPES)}"
        )
        return
    tensor = tensors.get_tensor(key)  # one tensor at a time
    if torch.isnan(tensor).any():
        found.invalid.append(f"tensor {key} contains NaN")
    elif torch.isinf(tensor).any():
        found.invalid.append(f"tensor {key} contains Inf")
    else:
        _check_served(key, tensor, spec.scaling_for(module_path) if spec and which == "B" else 1.0, found)


def _check_served(key: str, tensor: torch.Tensor, scaling: float, found: _Findings) -> None:
    """The tensor as an engine holds it (weights.load_adapter_weights: B times alpha/r, folded in float32,
    then cast) must stay finite: finite weights times a huge alpha overflow to Inf in half precision."""
    served = (tensor.to(torch.float32) * scaling).to(SERVED_DTYPE)
    if not torch.isfinite(served).all():
        largest = float(tensor.to(torch.float32).abs().max()) * scaling
        found.invalid.append(
            f"tensor {key} overflows to Inf as served: scaled by lora_alpha/r = {scaling:g} its largest "
            f"value {largest:.4g} exceeds what {SERVED_DTYPE} holds ({torch.finfo(SERVED_DTYPE).max:g})"
        )


def _check_shape(
    module_path: str,
    which: str,
    shape: list[int],
    layout: BaseModelLayout,
    spec: AdapterSpec | None,
    found: _Findings,
) -> None:
    in_features, out_features = layout.modules[module_path]
    if len(shape) != 2:
        found.invalid.append(f"lora_{which} of {module_path} has shape {shape}, expected a matrix")
        return
    rank = shape[0] if which == "A" else shape[1]
    found.halves.setdefault(module_path, {})[which] = rank
    if spec is not None:
        rank = spec.rank_for(module_path)
    expected = [rank, in_features] if which == "A" else [out_features, rank]
    if shape != expected:
        source = f" (rank {rank} from {CONFIG_FILE})" if spec is not None else ""
        found.invalid.append(f"lora_{which} of {module_path} has shape {shape}, expected {expected}{source}")
