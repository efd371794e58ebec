"""LinearGroup: the linears of a decoder layer that make its q/k/v or its gate/up outputs.

Llama, Mistral and Qwen2 have one linear per output (q_proj, k_proj, v_proj; gate_proj, up_proj). Phi-3 and
Phi-4 have one fused linear each (qkv_proj; gate_up_proj) whose output HF cuts into q, k, v (in that order,
at the head counts' widths) and into gate, up (two halves). A fused linear stays one projection member:
its adapter is PEFT's own, one A [r, in] and one B [q+k+v, r], so the rows of B are already the per-output
blocks and only the output is split, after base and LoRA delta are added (docs/decisions.md).
"""

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True, slots=True)
class LinearGroup:
    members: list[nn.Module]
    splits: tuple[int, ...] | None  # widths the one fused member's output is cut into; None: one per member


def qkv_group(attn: nn.Module, *, q_width: int) -> LinearGroup:
    """q, k, v of an attention module: HF's Phi3Attention slices qkv_proj's output into q (heads x head_dim
    wide), then k and v (equal, kv heads x head_dim each)."""
    fused = getattr(attn, "qkv_proj", None)
    if fused is None:
        return LinearGroup(_children(attn, "q_proj", "k_proj", "v_proj"), None)
    kv = (_out_features(fused) - q_width) // 2
    return LinearGroup([fused], (q_width, kv, kv))


def gate_up_group(mlp: nn.Module) -> LinearGroup:
    """gate then up of a gated MLP (HF's Phi3MLP: `gate, up = gate_up_proj(x).chunk(2, dim=-1)`)."""
    fused = getattr(mlp, "gate_up_proj", None)
    if fused is None:
        return LinearGroup(_children(mlp, "gate_proj", "up_proj"), None)
    half = _out_features(fused) // 2
    return LinearGroup([fused], (half, half))


def _children(module: nn.Module, *names: str) -> list[nn.Module]:
    return [module.get_submodule(name) for name in names]


def _out_features(linear: nn.Module) -> int:
    return int(getattr(linear, "out_features"))  # noqa: B009  (a LoRA wrapper or quantized linear)
