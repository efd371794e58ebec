"""AWQ "GEMM" int4 weights to a dense [in, out] matrix in the scales' dtype, on the device.

The layout is what AutoAWQ writes and gptqmodel's AWQ linears (TorchAtenAwqLinear on our CPU path) load,
see app/modelprep/awq_export.py: qweight int32 [in, out / 8] packs eight 4-bit codes per word along the
output axis, nibble j (bits 4j..4j+3) holding column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[j]; qzeros int32
[ceil(in / group), out / 8] the zero codes packed alike; scales [ceil(in / group), out]. The weight is
w[i, o] = (code[i, o] - zero[i // group, o]) * scale[i // group, o], the product rounded once to the scales'
dtype: gptqmodel's dequantize_gemm bit for bit. y = x @ w is then the layer's output.
"""

from __future__ import annotations

import torch

from deployments.engine.model.gpu_kernels._triton import cdiv, jit, require_triton, tl

BLOCK_K = 32
BLOCK_N = 64


@jit
def _awq_dequant_kernel(
    qweight_ptr, qzeros_ptr, scales_ptr, out_ptr, K, N, group_size,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_k < K)[:, None] & (offs_n < N)[None, :]
    words_per_row = N // 8
    lane = offs_n % 8
    # Column lane's nibble: the inverse of the packing order (0, 2, 4, 6, 1, 3, 5, 7).
    shifts = ((lane % 2) * 4 + lane // 2) * 4
    word_col = offs_n // 8
    words = tl.load(qweight_ptr + offs_k[:, None] * words_per_row + word_col[None, :], mask=mask, other=0)
    codes = (words >> shifts[None, :]) & 0xF
    groups = offs_k // group_size
    zero_words = tl.load(qzeros_ptr + groups[:, None] * words_per_row + word_col[None, :], mask=mask, other=0)
    zeros = (zero_words >> shifts[None, :]) & 0xF
    scales = tl.load(scales_ptr + groups[:, None] * N + offs_n[None, :], mask=mask, other=0.0)
    w = (codes - zeros).to(tl.float32) * scales.to(tl.float32)
    tl.store(out_ptr + offs_k[:, None] * N + offs_n[None, :], w.to(scales.dtype), mask=mask)


def awq_dequantize(
    qweight: torch.Tensor,  # [in, out / 8] int32
    qzeros: torch.Tensor,  # [ceil(in / group_size), out / 8] int32
    scales: torch.Tensor,  # [ceil(in / group_size), out] float16/bfloat16/float32
    group_size: int,
) -> torch.Tensor:
    """The dense weight [in, out] in scales' dtype (x @ it is the AWQ layer's output, bias aside)."""
    require_triton()
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError("qweight and qzeros must be int32 matrices (AWQ GEMM packing)")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = cdiv(k, group_size)
    if qzeros.shape != (groups, n // 8) or scales.shape != (groups, n):
        raise ValueError(
            f"for qweight {tuple(qweight.shape)} and group_size {group_size} want qzeros "
            f"{(groups, n // 8)} and scales {(groups, n)}; got {tuple(qzeros.shape)}, {tuple(scales.shape)}"
        )
    if not (qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()):
        raise ValueError("qweight, qzeros and scales must be contiguous")
    out = torch.empty(k, n, dtype=scales.dtype, device=scales.device)
    if k and n:
        _awq_dequant_kernel[(cdiv(k, BLOCK_K), cdiv(n, BLOCK_N))](
            qweight, qzeros, scales, out, k, n, group_size, BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N, num_warps=4
        )
    return out
