"""bitsandbytes NF4 linears as one Triton GEMM: y = x @ W^T with W dequantized tile by tile in registers.

bitsandbytes (0.50) runs a 4-bit linear at batch > 1 as dequantize-to-16-bit, then a dense GEMM: decode
then reads each weight in 4 bits, writes it in 16 and reads it again, in two launches per linear. Here a
decode step reads the 4-bit codes once.

The layout is what `bitsandbytes.functional.quantize_4bit` writes (its default/CUDA backends; see
backends/default/ops.py): the weight [N, K] (out, in) is flattened row-major, element e = n * K + k;
byte e // 2 holds element e in its high nibble when e is even, in its low nibble when odd (one padding
nibble when N * K is odd); block e // blocksize of the flattened weight has one fp32 absmax (blocks run
across rows when K is not a multiple of the block); the weight is
`(code[nibble] * absmax[e // blocksize]).to(dtype)` with `code` the 16-entry NF4 table, the product in fp32
and rounded once to the activations' dtype, as `gemm_4bit` dequantizes for `F.linear`. Double quantization
(8-bit absmax with a nested state) is undone once at load by the caller
(deployments/engine/model/nf4_base.py): the kernels take fp32 absmax.

Decode (T <= DECODE_ROWS): one row block holds every row, so the grid splits over N (and over K when N
alone gives too few programs, the partial sums added in a fixed order by a second small kernel): each
weight byte is read once per step. Each K tile is cut into sub-tiles of one absmax block per row when K is
a multiple of the block (one absmax load per row per sub-tile). Even and odd columns of a tile are two
`tl.dot`s (x's even columns with the high nibbles, odd with the low), so the nibbles are never interleaved
in registers. Prefill above `dequant_above` rows dequantizes once (`nf4_dequantize`) and uses the dense
GEMM: there the matmul is compute-bound and the dequantization is paid once for thousands of rows.
Grids depend on shapes (and the device's SM count) only: the decode path is CUDA-graph safe.
"""

from __future__ import annotations

import torch

from deployments.engine.model.gpu_kernels._triton import (
    cdiv,
    dot_precision,
    jit,
    next_power_of_2,
    require_triton,
    rows_out,
    sm_count,
    tl,
)

DECODE_ROWS = 64  # up to this many rows, one row block: the weight is read once per call
DEQUANT_ABOVE = 256  # rows above which prefill dequantizes once and runs the dense GEMM
BLOCK_N = 64
BLOCK_K = 256  # K per loop step (sub-tiles of one absmax block each): 128 contiguous bytes per weight row
NUM_WARPS = 8
# No software pipelining by default: Triton would stage the per-element code-table gathers through shared
# memory with cp.async (135 KB a program at BLOCK_K 256 and 3 stages, compiled for sm90 here); without
# it a program needs 8 KB and 78 registers a thread (ptxas -v), so several fit on an SM.
NUM_STAGES = 1
MAX_SPLIT = 16
DEQUANT_BLOCK = 1024  # bytes (2048 weights) per program of nf4_dequantize
REDUCE_BLOCK = 1024
CODES = 16


@jit
def _nf4_gemm_kernel(
    x_ptr, packed_ptr, absmax_ptr, code_ptr, bias_ptr, out_ptr,
    M, N, K, row_bytes, blocks_per_row, stride_xm, stride_om, split_len, stride_split,
    BLOCKSIZE: tl.constexpr, ALIGNED: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    HALF: tl.constexpr = SUB // 2
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    pairs = tl.arange(0, HALF)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    split = tl.program_id(2)  # this program's share of K: [split * split_len, (split + 1) * split_len)
    k_end = tl.minimum(K, (split + 1) * split_len)
    for k0 in range(split * split_len, k_end, BLOCK_K):
        for s in tl.static_range(BLOCK_K // SUB):
            k_sub = k0 + s * SUB
            if ALIGNED and EVEN_K:  # every real model: whole sub-tiles (K and the splits are multiples
                # of SUB), each in one absmax block of each row, a column pair one byte: masks constant
                # along K, so the loads vectorize
                live = k_sub < k_end
                x = tl.load(
                    x_ptr + offs_m[:, None] * stride_xm + (k_sub + tl.arange(0, SUB))[None, :],
                    mask=m_mask[:, None] & live,
                    other=0.0,
                )
                x_even, x_odd = tl.split(tl.reshape(x, [BLOCK_M, HALF, 2]))
                byte = tl.load(
                    packed_ptr + offs_n[None, :] * row_bytes + (k_sub // 2 + pairs)[:, None],
                    mask=n_mask[None, :] & live,
                    other=0,
                ).to(tl.int32)
                q_even = byte >> 4  # high nibble first
                q_odd = byte & 0xF
                scale = tl.load(
                    absmax_ptr + offs_n * blocks_per_row + k_sub // BLOCKSIZE, mask=n_mask & live, other=0.0
                )
                scale_even = scale[None, :]
                scale_odd = scale[None, :]
            else:  # any shape: per-element masks, nibbles and absmax blocks
                k_even = k_sub + 2 * pairs  # [HALF]: the tile's even columns; the odd ones are k_even + 1
                even_mask = k_even < k_end
                odd_mask = k_even + 1 < k_end
                x_rows = x_ptr + offs_m[:, None] * stride_xm + k_even[None, :]
                x_even = tl.load(x_rows, mask=m_mask[:, None] & even_mask[None, :], other=0.0)
                x_odd = tl.load(x_rows + 1, mask=m_mask[:, None] & odd_mask[None, :], other=0.0)
                w_even_mask = even_mask[:, None] & n_mask[None, :]  # [HALF, BLOCK_N]
                w_odd_mask = odd_mask[:, None] & n_mask[None, :]
                flat = offs_n[None, :] * K + k_even[:, None]  # the even columns' flat element index
                b_even = tl.load(packed_ptr + flat // 2, mask=w_even_mask, other=0).to(tl.int32)
                b_odd = tl.load(packed_ptr + (flat + 1) // 2, mask=w_odd_mask, other=0).to(tl.int32)
                q_even = (b_even >> ((1 - flat % 2) * 4)) & 0xF  # even elements sit in high nibbles
                q_odd = (b_odd >> (flat % 2 * 4)) & 0xF
                scale_even = tl.load(absmax_ptr + flat // BLOCKSIZE, mask=w_even_mask, other=0.0)
                scale_odd = tl.load(absmax_ptr + (flat + 1) // BLOCKSIZE, mask=w_odd_mask, other=0.0)
            w_even = (tl.load(code_ptr + q_even) * scale_even).to(dtype)  # fp32 product, rounded once
            w_odd = (tl.load(code_ptr + q_odd) * scale_odd).to(dtype)
            acc += tl.dot(x_even, w_even, input_precision=PRECISION)
            acc += tl.dot(x_odd, w_odd, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + split * stride_split + offs_m[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


@jit
def _split_sum_kernel(
    partial_ptr, bias_ptr, out_ptr, N, stride_split, stride_om,
    SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.load(partial_ptr + row * N + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):  # a fixed order: the same bits on every replay
        acc += tl.load(partial_ptr + s * stride_split + row * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _nf4_dequant_kernel(
    packed_ptr, absmax_ptr, code_ptr, out_ptr, numel, BLOCKSIZE: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # bytes; byte i holds elements 2i and 2i + 1
    even = 2 * offs
    even_mask = even < numel
    odd_mask = even + 1 < numel
    byte = tl.load(packed_ptr + offs, mask=even_mask, other=0).to(tl.int32)
    scale_even = tl.load(absmax_ptr + even // BLOCKSIZE, mask=even_mask, other=0.0)
    scale_odd = tl.load(absmax_ptr + (even + 1) // BLOCKSIZE, mask=odd_mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + even, (tl.load(code_ptr + (byte >> 4)) * scale_even).to(dtype), mask=even_mask)
    tl.store(out_ptr + even + 1, (tl.load(code_ptr + (byte & 0xF)) * scale_odd).to(dtype), mask=odd_mask)


def _check_weight(
    packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, n: int, k: int, blocksize: int
) -> None:
    if blocksize < 32 or blocksize & (blocksize - 1):
        raise ValueError(f"blocksize {blocksize} must be a power of 2 >= 32 (bitsandbytes: 32 ... 4096)")
    if n < 1 or k < 1 or n * k >= 2**31:
        raise ValueError(f"weight [{n}, {k}] must be non-empty with fewer than 2^31 elements")
    if packed.dtype != torch.uint8 or packed.numel() != cdiv(n * k, 2) or not packed.is_contiguous():
        raise ValueError(f"packed must be {cdiv(n * k, 2)} contiguous uint8 (two codes a byte)")
    if absmax.dtype != torch.float32 or absmax.numel() != cdiv(n * k, blocksize):
        raise ValueError(
            f"absmax must be {cdiv(n * k, blocksize)} float32 (dequantize a nested absmax first)"
        )
    if code.dtype != torch.float32 or code.numel() != CODES:
        raise ValueError("code must be the 16 float32 NF4 values")
    if not (absmax.is_contiguous() and code.is_contiguous()):
        raise ValueError("absmax and code must be contiguous")


def nf4_dequantize(
    packed: torch.Tensor,  # cdiv(N * K, 2) uint8, any shape (bitsandbytes keeps [n, 1])
    absmax: torch.Tensor,  # [cdiv(N * K, blocksize)] float32
    code: torch.Tensor,  # [16] float32
    *,
    out_features: int,
    in_features: int,
    blocksize: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The dense weight [N, K] in dtype: `bitsandbytes.functional.dequantize_4bit`'s values, one launch."""
    require_triton()
    n, k = out_features, in_features
    _check_weight(packed, absmax, code, n, k, blocksize)
    out = torch.empty(n, k, dtype=dtype, device=packed.device)
    _nf4_dequant_kernel[(cdiv(packed.numel(), DEQUANT_BLOCK),)](
        packed, absmax, code, out, n * k, BLOCKSIZE=blocksize, BLOCK=DEQUANT_BLOCK, num_warps=4
    )
    return out


def default_split_k(programs: int, k_steps: int, device: torch.device) -> int:
    """K splits when the N (and row) blocks alone leave SMs idle: about two programs per SM, at most
    MAX_SPLIT, never more than the K steps. From shapes and the device only."""
    sms = sm_count(device)
    if programs >= sms:
        return 1
    return max(1, min(cdiv(2 * sms, programs), k_steps, MAX_SPLIT))


def nf4_linear(
    x: torch.Tensor,  # [T, K] float16/bfloat16/float32, any row stride
    packed: torch.Tensor,  # cdiv(N * K, 2) uint8 (a Params4bit's data viewed as uint8)
    absmax: torch.Tensor,  # [cdiv(N * K, blocksize)] float32
    code: torch.Tensor,  # [16] float32 (quant_state.code)
    *,
    out_features: int,
    in_features: int,
    blocksize: int,
    bias: torch.Tensor | None = None,  # [N], added in fp32 before the one rounding
    out: torch.Tensor | None = None,  # [T, N] in x's dtype, any row stride
    split_k: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    dequant_above: int = DEQUANT_ABOVE,
) -> torch.Tensor:
    """x @ dequant(W)^T (+ bias) in x's dtype, fp32 accumulation: bitsandbytes' Linear4bit nf4 forward
    up to the order of the sum.

    Knobs (`python -m bench.gpu_kernels --sweep` times them): split_k (None: `default_split_k`), block_n
    and block_k (powers of 2; block_k >= 32), num_warps, num_stages; dequant_above the row count above
    which the weight is dequantized once and multiplied densely. Defaults are expectations, not yet
    measured on a GPU."""
    require_triton()
    n, k = out_features, in_features
    _check_weight(packed, absmax, code, n, k, blocksize)
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x must be [T, {k}] with a contiguous last dimension")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, not {x.dtype}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n}]")
    block_n = block_n or BLOCK_N
    block_k = block_k or BLOCK_K
    if block_n < 16 or block_n & (block_n - 1) or block_k < 32 or block_k & (block_k - 1):
        raise ValueError("block_n must be a power of 2 >= 16 and block_k a power of 2 >= 32")
    if split_k is not None and split_k < 1:
        raise ValueError("split_k must be >= 1")
    rows = x.shape[0]
    if rows > dequant_above:
        weight = nf4_dequantize(
            packed, absmax, code, out_features=n, in_features=k, blocksize=blocksize, dtype=x.dtype
        )
        y = torch.nn.functional.linear(x, weight, None if bias is None else bias.to(x.dtype))
        return y if out is None else rows_out(out, rows, n, x.dtype, x.device).copy_(y)
    out = rows_out(out, rows, n, x.dtype, x.device)
    if rows == 0:
        return out
    block_m = max(16, next_power_of_2(min(rows, DECODE_ROWS)))
    aligned = k % blocksize == 0
    sub = min(block_k, blocksize)
    row_blocks, col_blocks, k_steps = cdiv(rows, block_m), cdiv(n, block_n), cdiv(k, block_k)
    splits = split_k or default_split_k(row_blocks * col_blocks, k_steps, x.device)
    split_len = cdiv(k_steps, splits) * block_k  # whole K steps, so a sub-tile never straddles two splits
    splits = cdiv(k, split_len)
    target = out if splits == 1 else torch.empty(splits, rows, n, dtype=torch.float32, device=x.device)
    _nf4_gemm_kernel[(row_blocks, col_blocks, splits)](
        x, packed, absmax, code, bias if bias is not None else absmax, target,
        rows, n, k, k // 2, k // blocksize, x.stride(0), target.stride(-2), split_len,
        target.stride(0) if splits > 1 else 0,
        BLOCKSIZE=blocksize, ALIGNED=aligned, EVEN_K=k % 2 == 0, HAS_BIAS=bias is not None and splits == 1,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SUB=sub, PRECISION=dot_precision(x.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if splits > 1:
        _split_sum_kernel[(rows, cdiv(n, REDUCE_BLOCK))](
            target, bias if bias is not None else target, out, n, target.stride(0), out.stride(0),
            SPLITS=splits, HAS_BIAS=bias is not None, BLOCK=REDUCE_BLOCK, num_warps=4,
        )  # fmt: skip
    return out
