"""Load an AWQ GEMM int4 checkpoint without gptqmodel: the architecture dense from transformers, then each
quantized linear replaced by our AwqLinear (awq_base.py) holding the checkpoint's own packed tensors.

transformers loads AWQ checkpoints only through gptqmodel, which neither installs on the GPU image (no
package registry, torch 2.11) nor captures in a CUDA graph. So the checkpoint's config is read without its
quantization_config: transformers builds and loads the dense architecture (embeddings, norms, lm_head, the
biases of the quantized linears), leaving the quantized linears' `weight` missing (initialized, then dropped
here: a transient dense copy of those linears, freed before the engine sizes its KV cache), and the
qweight/qzeros/scales are read from the safetensors shards straight onto the device.
"""

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.utils import logging as hf_logging

from deployments.engine.model.awq_base import AwqLinear

log = logging.getLogger(__name__)

_PACKED = ("qweight", "qzeros", "scales")


class AwqCheckpointError(ValueError):
    """The checkpoint is not one our AWQ linear reads (the message says why)."""


def awq_settings(model_dir: Path) -> dict[str, Any]:
    """The checkpoint's quantization_config, checked to be AWQ GEMM int4 with zero points."""
    config = json.loads((model_dir / "config.json").read_text())
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or str(quant.get("quant_method")).lower() != "awq":
        raise AwqCheckpointError(f"{model_dir} is not an AWQ checkpoint")
    if int(quant.get("bits", 4)) != 4 or str(quant.get("version", "gemm")).lower() != "gemm":
        raise AwqCheckpointError(
            f"AWQ bits={quant.get('bits')} version={quant.get('version')}: only 4-bit GEMM packing is read"
        )
    return quant


def _shards(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    return sorted(model_dir.glob("*.safetensors"))


def _packed_tensors(model_dir: Path, device: torch.device) -> dict[str, dict[str, torch.Tensor]]:
    """module path -> {"qweight", "qzeros", "scales"} on the device, as stored."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for shard in _shards(model_dir):
        with safe_open(str(shard), framework="pt", device=str(device)) as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                module, _, leaf = key.rpartition(".")
                if leaf in _PACKED:
                    modules.setdefault(module, {})[leaf] = f.get_tensor(key)
    return modules


def load_awq_model(
    model_dir: Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str,
    fused_max_rows: int,
) -> PreTrainedModel:
    group_size = int(awq_settings(model_dir)["group_size"])
    hf_config = AutoConfig.from_pretrained(model_dir)
    delattr(hf_config, "quantization_config")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)  # the quantized linears' missing `weight`s are expected
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir,
            config=hf_config,
            dtype=dtype,
            attn_implementation=attn_implementation,
            device_map={"": device},
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    packed = _packed_tensors(model_dir, device)
    if not packed:
        raise AwqCheckpointError(f"{model_dir} holds no qweight/qzeros/scales")
    for path, tensors in packed.items():
        missing = [name for name in _PACKED if name not in tensors]
        dense = model.get_submodule(path)
        if missing or not isinstance(dense, nn.Linear):
            raise AwqCheckpointError(f"{path}: not an AWQ linear of this architecture (missing {missing})")
        awq = AwqLinear(
            tensors["qweight"],
            tensors["qzeros"],
            tensors["scales"].to(dtype),
            group_size=group_size,
            bias=None if dense.bias is None else dense.bias.data,
            fused_max_rows=fused_max_rows,
        )
        if (awq.in_features, awq.out_features) != (dense.in_features, dense.out_features):
            raise AwqCheckpointError(f"{path}: packed shape does not match the architecture's linear")
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent), name, awq)
    log.info("AWQ: %d linears on our int4 kernels (group %d) on %s", len(packed), group_size, device)
    return model
