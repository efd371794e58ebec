"""An AWQ int4 linear in one kernel: y = x @ W with W dequantized tile by tile in registers, never in memory.

Decode reads each weight once per step, so dequantizing the whole matrix first (awq_dequant.py) writes and
reads it again in 16 bits; here a step reads the 4-bit codes only. Each K tile lies in one quantization group
(BLOCK_K divides group_size), so a tile needs one row of zeros and scales. The tile's weights are rounded to
the scales' dtype exactly as awq_dequantize rounds them, then multiplied in that dtype with fp32
accumulation: the result is x @ awq_dequantize(...) up to the order of the sum.
"""

from __future__ import annotations

import torch

from deployments.engine.model.gpu_kernels._triton import (
    cdiv,
    dot_precision,
    jit,
    require_triton,
    rows_out,
    tl,
)

BLOCK_N = 64


@jit
def _awq_gemm_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, out_ptr, M, K, N, group_size, stride_xm, stride_om,
    split_len, stride_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    words_per_row = N // 8
    word_col = offs_n // 8
    lane = offs_n % 8
    shifts = ((lane % 2) * 4 + lane // 2) * 4  # as in awq_dequant.py
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    split = tl.program_id(2)  # this program's share of K: [split * split_len, (split + 1) * split_len)
    k_end = tl.minimum(K, (split + 1) * split_len)
    for k0 in range(split * split_len, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        tile_mask = k_mask[:, None] & n_mask[None, :]
        words = tl.load(
            qweight_ptr + offs_k[:, None] * words_per_row + word_col[None, :], mask=tile_mask, other=0
        )
        group = k0 // group_size
        zero_words = tl.load(qzeros_ptr + group * words_per_row + word_col, mask=n_mask, other=0)
        zeros = (zero_words >> shifts) & 0xF
        scales = tl.load(scales_ptr + group * N + offs_n, mask=n_mask, other=0.0)
        codes = (words >> shifts[None, :]) & 0xF
        w = ((codes - zeros[None, :]).to(tl.float32) * scales.to(tl.float32)[None, :]).to(scales.dtype)
        acc += tl.dot(x.to(scales.dtype), w, input_precision=PRECISION)
    tl.store(
        out_ptr + split * stride_split + offs_m[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def awq_linear(
    x: torch.Tensor,  # [T, in], any row stride
    qweight: torch.Tensor,  # [in, out / 8] int32
    qzeros: torch.Tensor,  # [in / group_size, out / 8] int32
    scales: torch.Tensor,  # [in / group_size, out]
    group_size: int,
    *,
    out: torch.Tensor | None = None,  # [T, out] in scales' dtype, any row stride
    split_k: int = 1,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """x @ awq_dequantize(qweight, qzeros, scales, group_size) in scales' dtype (x is cast to it), bias
    aside; group_size must be a power of 2 >= 16 (AWQ's are 32, 64 or 128) dividing in.

    Tuning knobs (`python -m bench.gpu_kernels --sweep`): split_k cuts K into that many runs of whole groups
    summed afterwards in fp32 (more programs for small batches); block_n, block_k (powers of 2 >= 16) the
    tile; num_warps, num_stages Triton's. The defaults are not tuned yet: on an H200 at batch 32 this took
    190 us for a 2048 x 5632 weight where awq_dequantize + matmul took 62 us."""
    if split_k < 1 or any(b is not None and (b < 16 or b & (b - 1)) for b in (block_n, block_k)):
        raise ValueError("split_k must be >= 1 and block_n, block_k powers of 2 >= 16")
    require_triton()
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError("qweight and qzeros must be int32 (AWQ GEMM packing)")
    if group_size < 16 or group_size & (group_size - 1) or k % group_size:
        raise ValueError(f"group_size {group_size} must be a power of 2 >= 16 dividing in_features {k}")
    if qzeros.shape != (k // group_size, n // 8) or scales.shape != (k // group_size, n):
        raise ValueError(f"qzeros/scales {tuple(qzeros.shape)}/{tuple(scales.shape)} do not match qweight")
    if not (qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()):
        raise ValueError("qweight, qzeros and scales must be contiguous")
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x must be [T, {k}] with a contiguous last dimension")
    rows = x.shape[0]
    out = rows_out(out, rows, n, scales.dtype, x.device)
    if rows == 0:
        return out
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n = block_n or BLOCK_N
    block_k = min(group_size, block_k or 64)
    groups_per_split = cdiv(k // group_size, split_k)
    split_len = groups_per_split * group_size  # whole groups, so no K tile straddles two splits
    splits = cdiv(k, split_len)
    target = out if splits == 1 else torch.empty(splits, rows, n, dtype=torch.float32, device=x.device)
    _awq_gemm_kernel[(cdiv(rows, block_m), cdiv(n, block_n), splits)](
        x, qweight, qzeros, scales, target, rows, k, n, group_size, x.stride(0), target.stride(-2),
        split_len, target.stride(0) if splits > 1 else 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=dot_precision(scales.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if splits > 1:
        out.copy_(target.sum(dim=0))  # fixed order: deterministic, unlike atomic adds
    return out
