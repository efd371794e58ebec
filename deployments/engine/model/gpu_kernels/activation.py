"""SiLU-and-mul over a fused gate/up projection: HF LlamaMLP's `act_fn(gate) * up`, bit for bit.

torch computes silu in fp32 (`x / (1 + exp(-x))`, IEEE division, the accurate expf on CUDA) and rounds it to
the dtype, then multiplies by up in fp32 and rounds again. On CUDA the kernel does the same with libdevice's
expf and a correctly rounded division. Triton's interpreter has no libdevice: there numpy's exp stands in,
which can differ from torch's by an ulp in fp32 (hidden by rounding to bf16/fp16 but for rare ties).
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


@jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_g, stride_o, inter,
    BLOCK: tl.constexpr, ACCURATE_EXP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(gate_up_ptr + row * stride_g + offs, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_g + inter + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    e = libdevice.exp(-g) if ACCURATE_EXP else tl.exp(-g)
    silu = tl.div_rn(g, 1.0 + e).to(gate.dtype)
    y = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(
    gate_up: torch.Tensor,  # [T, 2I], gate in the first half, up in the second; any row stride
    out: torch.Tensor | None = None,  # [T, I] in gate_up's dtype, any row stride
) -> torch.Tensor:
    """silu(gate) * up, rounded as torch rounds it, in gate_up's dtype."""
    require_triton()
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(
            f"gate_up must be [T, 2I] with a contiguous last dimension, got {tuple(gate_up.shape)}"
        )
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = rows_out(out, rows, inter, gate_up.dtype, gate_up.device)
    if rows and inter:
        _silu_and_mul_kernel[(rows, -(-inter // BLOCK))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter,
            BLOCK=BLOCK, ACCURATE_EXP=not interpreting(), num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return out
