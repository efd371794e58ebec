"""RMSNorm with HF LlamaRMSNorm's casts (or Gemma3RMSNorm's), optionally fused with the residual add before
it; a row a program.

HF: `h = residual + x` in x's dtype (the decoder layer's add; h is the next residual), then
`weight * (h.float() * rsqrt(mean(h.float() ** 2) + eps)).to(h.dtype)`, the product in the promoted dtype
of weight and h. The kernel rounds in the same places. It differs from torch only in the order of the sum
of squares and in rsqrt (computed here as a correctly rounded 1 / sqrt): one fp32 ulp in the scale, which
rounding to bf16/fp16 almost always hides.

Gemma's `unit_offset` norm keeps the normed row in fp32, multiplies it by the fp32 `1 + w` (computed once at
load, passed as the weight) and rounds once, to x's dtype:
`(x.float() * rsqrt(...) * (1 + w.float())).type_as(x)`.
"""

from __future__ import annotations

import torch

from deployments.engine.model.gpu_kernels._triton import jit, next_power_of_2, require_triton, tl


@jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    h = x
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + offs, h, mask=mask)
    hf = h.to(tl.float32)
    variance = tl.div_rn(tl.sum(hf * hf, 0), N * 1.0)
    inv = tl.div_rn(1.0, tl.sqrt_rn(variance + eps))
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    if UNIT_OFFSET:  # Gemma: no rounding between the norm and the (1 + w) product
        y = (hf * inv) * w.to(tl.float32)
    else:
        normed = (hf * inv).to(x.dtype)
        y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check_rows(name: str, t: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> None:
    if t.shape != shape or t.dtype != dtype or t.stride(1) != 1:
        raise ValueError(f"{name} must be {dtype} {tuple(shape)} with a contiguous last dimension")


def rms_norm(
    x: torch.Tensor,  # [T, hidden], any row stride
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, hidden] in x's dtype
    *,
    out: torch.Tensor | None = None,  # [T, hidden] in promote(weight, x) dtype; may be x itself
    residual_out: torch.Tensor | None = None,  # [T, hidden]; may be residual itself (in place)
    unit_offset: bool = False,  # Gemma's norm: weight is the fp32 (1 + w); out is in x's dtype
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF LlamaRMSNorm (or Gemma3RMSNorm) of x, or of x + residual (then returns (out, x + residual)). One
    launch."""
    require_triton()
    if x.dim() != 2 or weight.shape != (x.shape[1],) or not weight.is_contiguous():
        raise ValueError(
            f"want x [T, hidden] and a contiguous weight [hidden]; got {x.shape}, {weight.shape}"
        )
    if x.stride(1) != 1:
        raise ValueError("x needs a contiguous last dimension")
    if unit_offset and weight.dtype != torch.float32:
        raise ValueError("a unit-offset norm takes the fp32 (1 + w) as its weight")
    out_dtype = x.dtype if unit_offset else torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    _check_rows("out", out, x.shape, out_dtype)
    if residual is not None:
        _check_rows("residual", residual, x.shape, x.dtype)
        if residual_out is None:
            residual_out = torch.empty_like(x)
        _check_rows("residual_out", residual_out, x.shape, x.dtype)
    rows, hidden = x.shape
    if rows:
        block = next_power_of_2(hidden)
        r = x if residual is None else residual
        ro = out if residual_out is None else residual_out
        _rms_norm_kernel[(rows,)](
            x, r, weight, out, ro, x.stride(0), r.stride(0), out.stride(0), ro.stride(0), eps,
            N=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
            UNIT_OFFSET=unit_offset, num_warps=min(16, max(1, block // 512)),
            enable_fp_fusion=False,
        )  # fmt: skip
    if residual_out is None:
        return out
    return out, residual_out
