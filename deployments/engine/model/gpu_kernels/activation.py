"""Gated activations over a fused gate/up projection, bit for bit as HF computes them: LlamaMLP's
`silu(gate) * up` and Gemma's GeGLU, `gelu(gate, approximate="tanh") * up`.

torch computes the activation in fp32 and rounds it to the dtype, then multiplies by up in fp32 and rounds
again; the kernel rounds in the same places. silu is `x / (1 + exp(-x))` (IEEE division, the accurate expf
on CUDA); the tanh GELU is torch's `0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))` with libdevice's
tanhf (nvcc may contract torch's own arithmetic into FMAs: an fp32 ulp, which rounding to 16 bits rarely
shows). Triton's interpreter has no libdevice: there numpy's exp stands in, and tanh is written with it,
which can differ from torch's by an ulp or two in fp32.
"""

from __future__ import annotations

import torch

from deployments.engine.model.gpu_kernels._triton import (
    interpreting,
    jit,
    libdevice,
    require_triton,
    rows_out,
    tl,
)

BLOCK = 1024
SILU, GELU_TANH = 0, 1


@jit
def _gated_kernel(
    gate_up_ptr, out_ptr, stride_g, stride_o, inter,
    BLOCK: tl.constexpr, ACTIVATION: tl.constexpr, ACCURATE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(gate_up_ptr + row * stride_g + offs, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_g + inter + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if ACTIVATION == 0:
        e = libdevice.exp(-g) if ACCURATE else tl.exp(-g)
        act = tl.div_rn(g, 1.0 + e)
    else:
        # torch's kBeta (M_SQRT2 * M_2_SQRTPI * 0.5, i.e. sqrt(2 / pi)) and kKappa, in its order
        inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
        if ACCURATE:
            t = libdevice.tanh(inner)
        else:  # tanh through exp, each side written so that it keeps to about an ulp of 1 near +-1
            e = tl.exp(2.0 * tl.minimum(inner, 0.0))
            t = tl.where(
                inner < 0, tl.div_rn(e - 1.0, e + 1.0), 1.0 - tl.div_rn(2.0, tl.exp(2.0 * inner) + 1.0)
            )
        act = 0.5 * g * (1.0 + t)
    y = act.to(gate.dtype).to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _gated(gate_up: torch.Tensor, out: torch.Tensor | None, activation: int) -> torch.Tensor:
    require_triton()
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(
            f"gate_up must be [T, 2I] with a contiguous last dimension, got {tuple(gate_up.shape)}"
        )
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = rows_out(out, rows, inter, gate_up.dtype, gate_up.device)
    if rows and inter:
        _gated_kernel[(rows, -(-inter // BLOCK))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter,
            BLOCK=BLOCK, ACTIVATION=activation, ACCURATE=not interpreting(), num_warps=4,
            enable_fp_fusion=False,
        )  # fmt: skip
    return out


def silu_and_mul(
    gate_up: torch.Tensor,  # [T, 2I], gate in the first half, up in the second; any row stride
    out: torch.Tensor | None = None,  # [T, I] in gate_up's dtype, any row stride
) -> torch.Tensor:
    """silu(gate) * up, rounded as torch rounds it, in gate_up's dtype."""
    return _gated(gate_up, out, SILU)


def gelu_tanh_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up (Gemma's GeGLU), rounded as torch rounds it; as silu_and_mul."""
    return _gated(gate_up, out, GELU_TANH)
