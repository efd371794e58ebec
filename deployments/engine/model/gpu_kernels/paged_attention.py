"""Paged decode attention: one query token per sequence, attending over its K/V where they lie in the cache.

The cache is flat and slot-major ([num_blocks * block_size, Hkv, D], slot = block_id * block_size + offset),
so a program gathers K/V rows position by position through the block table and never assumes a block holds
a whole tile: any block_size from 1 up works. One program per (sequence, kv head, partition) serves that kv
head's G query heads together (GQA: query head h reads kv head h // G), padded to 16 rows for tl.dot, with
an online softmax in fp32 over BLOCK_N positions at a time.

Split-K (flash-decoding): with few sequences B * Hkv programs leave most SMs idle, so each context is cut
into a fixed number of partitions, chosen from the table's width (W * block_size positions) and the grid,
never from context_lens, so a captured graph stays valid for every step of its bucket. Each partition
writes its unnormalised output, running max and sum; a second kernel combines them. Partitions beyond a
sequence's context run no loop iteration and write an empty result (sum 0).
"""

from __future__ import annotations

import torch

from deployments.engine.model.gpu_kernels._triton import (
    cdiv,
    dot_precision,
    jit,
    next_power_of_2,
    require_triton,
    sm_count,
    tl,
)
from deployments.engine.model.gpu_kernels.flash_step import cache_slots, online_softmax

LOG2E = 1.4426950408889634
MIN_PARTITION = 256  # positions; shorter partitions cost more in the combine than they save


@jit
def _attend_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb, stride_ob, stride_oh,
    qk_scale, window, part_len, num_parts,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    start = tl.maximum(lo, part * part_len)
    end = tl.minimum(ctx, (part + 1) * part_len)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_mask = offs_g < G
    d_mask = offs_d < D
    heads = kvh * G + offs_g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [G_PAD, D_PAD]

    # Running max in log2 units; finite when no position was seen, so combining partitions never makes NaN.
    m_i = tl.full([G_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    table_row = tables_ptr + b * stride_tb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        slots = cache_slots(table_row, offs_n, valid, BLOCK_SIZE)  # [BLOCK_N]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0
        )  # [BLOCK_N, D_PAD]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [G_PAD, BLOCK_N], log2 units
        s = tl.where(valid[None, :], s, float("-inf"))
        v = tl.load(
            v_ptr + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0
        )
        m_i, l_i, acc = online_softmax(s, v, m_i, l_i, acc, PRECISION)

    tile_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        row = (b * tl.num_programs(1) * G + heads) * num_parts + part  # [G_PAD] into [B, H, P]
        tl.store(part_acc_ptr + row[:, None] * D + offs_d[None, :], acc, mask=tile_mask)
        tl.store(part_max_ptr + row, m_i, mask=g_mask)
        tl.store(part_sum_ptr + row, l_i, mask=g_mask)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty context writes zeros
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=tile_mask,
        )


@jit
def _combine_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, stride_ob, stride_oh, num_parts,
    D: tl.constexpr, D_PAD: tl.constexpr, P_PAD: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.arange(0, P_PAD)
    offs_d = tl.arange(0, D_PAD)
    p_mask = offs_p < num_parts
    row = (b * tl.num_programs(1) + h) * num_parts + offs_p
    m = tl.load(part_max_ptr + row, mask=p_mask, other=-1.0e30)
    sums = tl.load(part_sum_ptr + row, mask=p_mask, other=0.0)
    acc = tl.load(
        part_acc_ptr + row[:, None] * D + offs_d[None, :],
        mask=p_mask[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )  # [P_PAD, D_PAD]
    weight = tl.exp2(m - tl.max(m, 0))  # [P_PAD]; empty partitions have sum 0 and acc 0
    total = tl.sum(weight * sums, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < D
    )


def num_partitions(batch: int, kv_heads: int, max_positions: int, device: torch.device) -> int:
    """Split-K partitions per sequence, from shapes only. Measured on an H200 (bench-1b, bf16): about four
    programs per SM is best, and with two per SM unsplit already beats any split; no partition is shorter
    than MIN_PARTITION positions."""
    programs = batch * kv_heads
    sms = sm_count(device)
    if programs >= 2 * sms:
        return 1
    return max(1, min(cdiv(4 * sms, programs), max_positions // MIN_PARTITION))


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
) -> None:
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"want q [B, H, D] and caches [slots, Hkv, D]; got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != dim or heads % kv_heads != 0:
        raise ValueError(
            f"q {tuple(q.shape)} does not match the cache's [slots, Hkv, D] {tuple(k_cache.shape)}"
        )
    index_dtypes = (torch.int32, torch.int64)  # the engine packs its step metadata in int64
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.dtype not in index_dtypes:
        raise ValueError(
            f"block_tables must be int32/int64 [B={batch}, W], got {block_tables.dtype} {block_tables.shape}"
        )
    if context_lens.shape != (batch,) or context_lens.dtype not in index_dtypes:
        raise ValueError(
            f"context_lens must be int32/int64 [B={batch}], got {context_lens.dtype} {context_lens.shape}"
        )
    if block_size < 1 or k_cache.shape[0] % block_size != 0:
        raise ValueError(f"block_size {block_size} must divide the cache's {k_cache.shape[0]} slots")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or block_tables.stride(1) != 1:
        raise ValueError("q, the caches and block_tables need a contiguous last dimension")
    if not context_lens.is_contiguous():
        raise ValueError("context_lens must be contiguous")


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D], any row strides
    k_cache: torch.Tensor,  # [num_blocks * block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks * block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, W] int32 or int64
    context_lens: torch.Tensor,  # [B] int32 or int64, each <= W * block_size
    *,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,  # [B, H, D] in q's dtype, any row strides
    partitions: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v over each sequence's first context_lens[b] cached positions (those >=
    context_lens[b] - sliding_window when a window is given), fp32 softmax, output in q's dtype.

    A sequence with context 0 gets zeros. `partitions` forces the split-K count (1: no split; None: from
    the shapes, see num_partitions); `block_n` the positions per inner step (a power of 2, >= 16).
    Graph-safe: nothing here reads a tensor's values.
    """
    require_triton()
    _check(q, k_cache, v_cache, block_tables, context_lens, block_size)
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} with a contiguous last dimension")
    if batch == 0:
        return out
    max_positions = block_tables.shape[1] * block_size
    if block_n is None:  # 128 was fastest at head_dim 64 on an H200 at every batch and context measured
        block_n = 128 if dim <= 64 else 64
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of 2 >= 16, got {block_n}")
    if partitions is None:
        partitions = num_partitions(batch, kv_heads, max_positions, q.device)
    part_len = block_n * cdiv(cdiv(max(max_positions, 1), partitions), block_n)
    parts = cdiv(max(max_positions, 1), part_len)  # no partition is empty for every sequence
    split = parts > 1
    if split:
        part_acc = torch.empty(batch, heads, parts, dim, dtype=torch.float32, device=q.device)
        part_max = torch.empty(batch, heads, parts, dtype=torch.float32, device=q.device)
        part_sum = torch.empty(batch, heads, parts, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_max = part_sum = out  # unused by the kernel without SPLIT
    d_pad = max(16, next_power_of_2(dim))
    _attend_kernel[(batch, kv_heads, parts)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_max, part_sum,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        scale * LOG2E, 0 if sliding_window is None else sliding_window, part_len, parts,
        G=group, G_PAD=max(16, next_power_of_2(group)), D=dim, D_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, HAS_WINDOW=sliding_window is not None, SPLIT=split,
        PRECISION=dot_precision(q.dtype), num_warps=4,
    )  # fmt: skip
    if split:
        _combine_kernel[(batch, heads)](
            part_acc, part_max, part_sum, out, out.stride(0), out.stride(1), parts,
            D=dim, D_PAD=d_pad, P_PAD=max(2, next_power_of_2(parts)), num_warps=4,
        )  # fmt: skip
    return out
