"""Write an AWQ (GEMM, int4) checkpoint from a plain HF causal LM, without calibration or an accelerator.

AutoAWQ is deprecated and gptqmodel's AWQ *calibration* needs an accelerator, yet tests and benchmarks need
AWQ checkpoints that transformers (via gptqmodel) loads. This module quantizes round-to-nearest (RTN) and
stores the result in AWQ's GEMM layout, bit for bit what AutoAWQ / gptqmodel write and read:

* ``qweight`` int32 ``[in, out / 8]``: eight 4-bit codes per word along the output axis, nibble ``j`` (bits
  ``4j .. 4j+3``) holding column ``8c + GEMM_PACK_ORDER[j]`` (AWQ's interleaved order ``0 2 4 6 1 3 5 7``);
* ``qzeros`` int32 ``[in / group, out / 8]``: the zero-point codes, packed the same way;
* ``scales`` float16 ``[in / group, out]``;
* weight ``w[o, i] = (code[i, o] - zero[i // group, o]) * scale[i // group, o]``.

Only the decoder layers' q/k/v/o/gate/up/down projections (Phi-3's fused qkv and gate_up) are quantized;
embeddings, ``lm_head``, norms and any other linear stay in ``dtype`` and are listed in
``modules_to_not_convert``.

Constraints: ``group_size`` must be one of ``SUPPORTED_GROUP_SIZES`` (what gptqmodel's CPU int4 kernel,
``TorchAtenAwqLinear``, accepts) and must divide every quantized linear's ``in_features``; ``out_features``
must be a multiple of 8 (one int32 word of codes).
"""

import argparse
import json
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

BITS: Final = 4
PACK_FACTOR: Final = 32 // BITS  # codes per int32 word
MAX_CODE: Final = (1 << BITS) - 1
# Nibble j of a packed word holds column GEMM_PACK_ORDER[j] of its block of 8 (AutoAWQ's WQLinear_GEMM.pack,
# gptqmodel.quantization.awq.utils.packing_utils.AWQ_ORDER).
GEMM_PACK_ORDER: Final = (0, 2, 4, 6, 1, 3, 5, 7)
_GEMM_UNPACK_ORDER: Final = tuple(GEMM_PACK_ORDER.index(c) for c in range(PACK_FACTOR))
SUPPORTED_GROUP_SIZES: Final = (16, 32, 64, 128)
SUPPORTED_DTYPES: Final = (torch.float16, torch.bfloat16, torch.float32)

SAFE_WEIGHTS_NAME: Final = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME: Final = "model.safetensors.index.json"
# Weight formats we neither read nor copy: a stale .bin next to the AWQ safetensors would confuse loaders.
_WEIGHT_SUFFIXES: Final = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_SKIP_FILES: Final = frozenset({"config.json", SAFE_WEIGHTS_INDEX_NAME, "pytorch_model.bin.index.json"})

# Phi-3's fused qkv_proj and gate_up_proj are quantized whole, as AutoAWQ's Phi-3 checkpoints store them.
_QUANTIZED_WEIGHT = re.compile(
    r"^(?P<module>(?:.+\.)?layers\.\d+\."
    r"(?:self_attn\.(?:q|k|v|o|qkv)_proj|mlp\.(?:gate|up|down|gate_up)_proj))\.weight$"
)


class AwqExportError(ValueError):
    """The source model or the options cannot be exported to AWQ GEMM int4; the message says why."""


@dataclass(frozen=True, slots=True)
class AwqGemmTensors:
    """One linear in AWQ GEMM storage (see the module docstring for shapes and layout)."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor


def check_group_size(group_size: int, in_features: int | None = None, *, name: str = "linear") -> None:
    """Raise AwqExportError unless ``group_size`` is supported and divides ``in_features`` (when given)."""
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise AwqExportError(
            f"group_size must be one of {SUPPORTED_GROUP_SIZES} (gptqmodel's CPU AWQ kernel), "
            f"got {group_size}"
        )
    if in_features is not None and in_features % group_size != 0:
        raise AwqExportError(
            f"group_size {group_size} must divide in_features {in_features} of {name}; "
            f"choose one of {[g for g in SUPPORTED_GROUP_SIZES if in_features % g == 0]}"
        )


def _round_up_to_fp16(scales: torch.Tensor) -> torch.Tensor:
    # The stored fp16 scale must not be smaller than the exact one, or the extreme weights of a group would
    # fall outside the 16 codes and be clipped by more than half a step.
    rounded = scales.to(torch.float16)
    up = torch.nextafter(rounded, torch.full_like(rounded, float("inf")))
    return torch.where(rounded.float() < scales, up, rounded)


def quantize_rtn(
    weight: torch.Tensor, group_size: int, *, zero_point: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest int4 per group of ``group_size`` inputs, in AWQ's convention.

    ``weight`` is ``[out, in]`` (nn.Linear layout). Returns natural-order ``codes`` int32 ``[in, out]``,
    ``zeros`` int32 ``[in / group, out]`` and ``scales`` float16 ``[in / group, out]``; every element
    satisfies ``|w - (code - zero) * scale| <= scale / 2``. Asymmetric (``zero_point``) uses the group's
    range widened to include 0; symmetric uses ``scale = max|w| / 7`` and zero 8, as AutoAWQ.
    """
    out_features, in_features = weight.shape
    check_group_size(group_size, in_features)
    w = weight.detach().to(torch.float32).reshape(out_features, in_features // group_size, group_size)
    if not bool(torch.isfinite(w).all()):
        raise AwqExportError("weight has non-finite values")
    if zero_point:
        # Widening to 0 keeps the zero code within 0..15: AWQ clamps it there, so a group that does not
        # straddle 0 would otherwise lose its far end.
        low = w.amin(dim=-1).clamp(max=0.0)
        high = w.amax(dim=-1).clamp(min=0.0)
        scales = _round_up_to_fp16(((high - low) / MAX_CODE).clamp(min=1e-5))
        zeros = torch.round(-low / scales.float()).clamp(0, MAX_CODE)
    else:
        scales = _round_up_to_fp16((w.abs().amax(dim=-1) / (MAX_CODE // 2)).clamp(min=1e-5))
        zeros = torch.full_like(scales, (MAX_CODE + 1) // 2, dtype=torch.float32)
    if not bool(torch.isfinite(scales).all()):
        raise AwqExportError("weight range overflows float16 scales")
    codes = (torch.round(w / scales.float()[..., None]) + zeros[..., None]).clamp(0, MAX_CODE)
    return (
        codes.reshape(out_features, in_features).t().to(torch.int32).contiguous(),
        zeros.t().to(torch.int32).contiguous(),
        scales.t().contiguous(),
    )


def pack_gemm(codes: torch.Tensor) -> torch.Tensor:
    """Pack int4 codes ``[rows, cols]`` (natural column order) into int32 ``[rows, cols / 8]``, AWQ order."""
    rows, cols = codes.shape
    if cols % PACK_FACTOR != 0:
        raise AwqExportError(f"AWQ GEMM packs {PACK_FACTOR} columns per int32; {cols} is not a multiple")
    lanes = codes.to(torch.int64).reshape(rows, cols // PACK_FACTOR, PACK_FACTOR)[..., list(GEMM_PACK_ORDER)]
    shifts = torch.arange(0, 32, BITS, dtype=torch.int64)
    words = (lanes << shifts).sum(dim=-1)
    # Reinterpret as two's complement explicitly rather than rely on int64 -> int32 cast wrap-around.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_gemm(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_gemm``: int32 ``[rows, cols / 8]`` to int32 codes ``[rows, cols]``, natural order."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int64)
    lanes = ((packed.to(torch.int64) & 0xFFFFFFFF)[..., None] >> shifts) & MAX_CODE
    return lanes[..., list(_GEMM_UNPACK_ORDER)].reshape(packed.shape[0], -1).to(torch.int32)


def quantize_linear_weight(
    weight: torch.Tensor, group_size: int, *, zero_point: bool = True
) -> AwqGemmTensors:
    """RTN-quantize an nn.Linear weight ``[out, in]`` and pack it in AWQ GEMM layout."""
    codes, zeros, scales = quantize_rtn(weight, group_size, zero_point=zero_point)
    return AwqGemmTensors(qweight=pack_gemm(codes), qzeros=pack_gemm(zeros), scales=scales)


def dequantize_gemm(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Reference dequantizer: AWQ GEMM tensors to a float32 weight ``[out, in]`` (nn.Linear layout).

    Exact in float32. gptqmodel's CPU kernel computes with bf16 scales and bf16 activations, so served outputs
    differ from a float32 matmul with this weight by bf16 rounding.
    """
    codes = unpack_gemm(qweight)
    zeros = unpack_gemm(qzeros).repeat_interleave(group_size, dim=0)
    weight = (codes - zeros).to(torch.float32) * scales.to(torch.float32).repeat_interleave(group_size, dim=0)
    return weight.t().contiguous()


def dequantize_module(module: nn.Module) -> torch.Tensor:
    """Dequantize a loaded gptqmodel AWQ linear (float32 ``[out, in]``) from its ``qweight/qzeros/scales``.

    Call it before the module's first no-grad eval forward: gptqmodel's ``TorchAtenAwqLinear`` then repacks
    those buffers in place into the ATen int4pack format, after which they are no longer AWQ GEMM tensors.
    """
    if getattr(module, "linear_mode", None) == "inference":
        raise AwqExportError(f"{type(module).__name__} already repacked its buffers for the CPU int4 kernel")
    tensors = [getattr(module, name, None) for name in ("qweight", "qzeros", "scales")]
    group_size = getattr(module, "group_size", None)
    qweight, qzeros, scales = tensors
    if not (
        isinstance(qweight, torch.Tensor)
        and isinstance(qzeros, torch.Tensor)
        and isinstance(scales, torch.Tensor)
        and isinstance(group_size, int)
    ):
        raise AwqExportError(f"{type(module).__name__} is not an AWQ GEMM linear")
    return dequantize_gemm(qweight, qzeros, scales, group_size)


def _read_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise AwqExportError(f"{path} is not a JSON object")
    return data


def _shard_names(model_dir: Path) -> list[str]:
    index = model_dir / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise AwqExportError(f"{index} has no weight_map")
        return sorted({str(v) for v in weight_map.values()})
    if (model_dir / SAFE_WEIGHTS_NAME).is_file():
        return [SAFE_WEIGHTS_NAME]
    raise AwqExportError(f"{model_dir} has no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}")


def load_dequantized_state_dict(awq_dir: Path) -> dict[str, torch.Tensor]:
    """Read an AWQ GEMM checkpoint back as a float32 state dict of the unquantized architecture.

    Each ``<module>.qweight/qzeros/scales`` triple becomes ``<module>.weight`` (reference dequantization),
    every other floating tensor is cast to float32. Load it into ``AutoModelForCausalLM.from_config`` of the
    same config without ``quantization_config`` to get a dense model with the checkpoint's effective weights
    (``strict=False`` when embeddings are tied: the checkpoint then has no ``lm_head.weight``).
    """
    awq_dir = Path(awq_dir)
    qconfig = _read_json(awq_dir / "config.json").get("quantization_config")
    if not isinstance(qconfig, dict) or qconfig.get("quant_method") != "awq":
        raise AwqExportError(f"{awq_dir} is not an AWQ checkpoint")
    group_size = int(qconfig["group_size"])
    raw: dict[str, torch.Tensor] = {}
    for shard in _shard_names(awq_dir):
        with safe_open(str(awq_dir / shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                raw[key] = f.get_tensor(key)
    state: dict[str, torch.Tensor] = {}
    for key, tensor in raw.items():
        if key.endswith((".qzeros", ".scales")):
            continue
        if key.endswith(".qweight"):
            module = key.removesuffix(".qweight")
            weight = dequantize_gemm(tensor, raw[f"{module}.qzeros"], raw[f"{module}.scales"], group_size)
            state[f"{module}.weight"] = weight
        else:
            state[key] = tensor.float() if tensor.is_floating_point() else tensor
    return state


def _unquantized_linears(config: Any, quantized_modules: set[str]) -> list[str]:
    # Transformers swaps every nn.Linear not named here for an AWQ linear, so list all that we leave dense
    # (lm_head, and for other architectures e.g. a router); a meta-device model costs no memory.
    with torch.device("meta"):
        model: nn.Module = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    return sorted(
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name not in quantized_modules
    )


def export_awq(
    src_model_dir: Path,
    out_dir: Path,
    *,
    group_size: int = 128,
    zero_point: bool = True,
    dtype: torch.dtype = torch.float16,
) -> Path:
    """Export ``src_model_dir`` (HF causal LM, safetensors) to an AWQ GEMM int4 checkpoint in ``out_dir``.

    Round-to-nearest per group of ``group_size`` input channels, asymmetric when ``zero_point``. This is AWQ's
    storage format only: no activation-aware scale search (no calibration data) is done, so accuracy is that
    of plain RTN int4, below a calibrated AWQ checkpoint of the same model. Unquantized tensors (embeddings,
    norms, lm_head) are stored in ``dtype`` (fp16 is the AWQ convention) and ``config.dtype`` is set to it.
    Tokenizer, generation config and other non-weight files are copied. ``out_dir`` must not exist or be
    empty. Returns ``out_dir``.
    """
    src, out = Path(src_model_dir), Path(out_dir)
    check_group_size(group_size)
    if dtype not in SUPPORTED_DTYPES:
        raise AwqExportError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
    config_dict = _read_json(src / "config.json")
    if "quantization_config" in config_dict:
        raise AwqExportError(f"{src} is already quantized ({config_dict['quantization_config']!r})")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise AwqExportError(f"{out} exists and is not an empty directory")
    if out.resolve() == src.resolve():
        raise AwqExportError("out_dir must differ from src_model_dir")
    shards = _shard_names(src)

    # Quantize everything in memory first so that a bad shape leaves no half-written out_dir behind.
    written: dict[str, dict[str, torch.Tensor]] = {}
    quantized_modules: set[str] = set()
    for shard in shards:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(src / shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                tensor = f.get_tensor(key)
                match = _QUANTIZED_WEIGHT.match(key)
                if match is not None and tensor.ndim == 2:
                    module = match["module"]
                    out_features, in_features = tensor.shape
                    check_group_size(group_size, in_features, name=module)
                    if out_features % PACK_FACTOR != 0:
                        raise AwqExportError(
                            f"out_features {out_features} of {module} must be a multiple of {PACK_FACTOR}"
                        )
                    packed = quantize_linear_weight(tensor, group_size, zero_point=zero_point)
                    tensors[f"{module}.qweight"] = packed.qweight
                    tensors[f"{module}.qzeros"] = packed.qzeros
                    tensors[f"{module}.scales"] = packed.scales
                    quantized_modules.add(module)
                elif tensor.is_floating_point():
                    # A quantized linear's bias lives in the AWQ module's fp16 buffer.
                    bias_of = key.removesuffix(".bias")
                    is_awq_bias = key.endswith(".bias") and _QUANTIZED_WEIGHT.match(f"{bias_of}.weight")
                    tensors[key] = tensor.to(torch.float16 if is_awq_bias else dtype).contiguous()
                else:
                    tensors[key] = tensor
        written[shard] = tensors
    if not quantized_modules:
        raise AwqExportError(f"no decoder-layer q/k/v/o/gate/up/down_proj weights found in {src}")

    config = AutoConfig.from_pretrained(src)
    not_converted = _unquantized_linears(config, quantized_modules)

    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total_size = 0
    for shard, tensors in written.items():
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        for key, tensor in tensors.items():
            weight_map[key] = shard
            total_size += tensor.numel() * tensor.element_size()
    if len(shards) > 1 or (src / SAFE_WEIGHTS_INDEX_NAME).is_file():
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (out / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")

    config_dict.pop("torch_dtype", None)
    config_dict["dtype"] = str(dtype).removeprefix("torch.")
    config_dict["quantization_config"] = {
        "quant_method": "awq",
        "bits": BITS,
        "group_size": group_size,
        "zero_point": zero_point,
        # "version" is what AutoAWQ and vLLM read; transformers' AwqConfig maps it to "format".
        "version": "gemm",
        "format": "gemm",
        "modules_to_not_convert": not_converted,
    }
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")

    for path in sorted(src.iterdir()):
        if path.is_file() and path.name not in _SKIP_FILES and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, out / path.name)
    return out


_DTYPES_BY_NAME: Final = {str(d).removeprefix("torch."): d for d in SUPPORTED_DTYPES}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m app.modelprep.awq_export",
        description="Export an HF causal LM to an AWQ GEMM int4 checkpoint: round-to-nearest, no calibration",
    )
    parser.add_argument("src", type=Path, help="source model directory (config.json + safetensors)")
    parser.add_argument("out", type=Path, help="output directory (must not exist or be empty)")
    parser.add_argument("--group-size", type=int, default=128, choices=SUPPORTED_GROUP_SIZES)
    parser.add_argument("--no-zero-point", action="store_true", help="symmetric int4 (zero code fixed at 8)")
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES_BY_NAME), default="float16", help="dtype of unquantized tensors"
    )
    args = parser.parse_args(argv)
    try:
        out = export_awq(
            args.src,
            args.out,
            group_size=args.group_size,
            zero_point=not args.no_zero_point,
            dtype=_DTYPES_BY_NAME[args.dtype],
        )
    except AwqExportError as exc:
        parser.exit(2, f"error: {exc}\n")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
