"""Paged prefill attention: every chunk of a step (several new tokens of one sequence each) in one launch.

A step packs its sequences' new tokens into q [T, H, D]. Chunk c owns q rows [query_start[c], query_start[c] +
query_len[c]) at absolute positions context_len[c] - query_len[c] .. context_len[c] - 1, and its K/V (the
cached prefix and its own new tokens, which the rotary + cache kernel already wrote) lie in the paged cache
behind block_tables[c]. Each query attends causally, bottom-right aligned: keys at positions <= its own (and
> its own - window with a sliding window). Decode rows are chunks of length 1, so a mixed step is one launch.

Grid (query tiles, kv heads). A program serves one kv head's G query heads for BLOCK_Q consecutive queries of
one chunk together (GQA: BLOCK_M = BLOCK_Q * G rows share each K/V tile read), gathers K/V rows position by
position through the block table (any block_size from 1 up, as the decode kernel), and runs an fp32 online
softmax over BLOCK_N keys at a time, only up to its last query's position. Chunk c's tiles are numbered
from query_start[c] // BLOCK_Q + c: chunks ascend and do not overlap, so these ranges are disjoint and all
fit in cdiv(T, BLOCK_Q) + N - 1 programs, a count from shapes alone (no host read of the lengths, no launch
per chunk, and no (chunks x longest chunk) grid of mostly idle programs). A program finds its chunk by
counting the chunks whose first tile is <= its own, one vector load per 128 chunks; a program in a gap
between two chunks' ranges finds no query row and writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deployments.engine.model.gpu_kernels._triton import (
    cdiv,
    dot_precision,
    next_power_of_2,
    require_triton,
    tl,
    triton,
)
from deployments.engine.model.gpu_kernels.flash_step import cache_slots, online_softmax

LOG2E = 1.4426950408889634
SCAN = 128  # chunks looked at per vector load while a program finds its chunk


def _jit_once(fn: Callable[..., None]) -> Any:
    """`triton.jit`, without specializing on what changes step to step (the chunk count, the table width,
    where the metadata views sit in the step buffer): one compile per model, not one per variant while
    serving (each costs about a second)."""
    if triton is None:
        return fn
    return triton.jit(
        fn,
        do_not_specialize=["num_chunks", "stride_tb"],
        do_not_specialize_on_alignment=["starts_ptr", "qlens_ptr", "ctxs_ptr", "tables_ptr"],
    )


@_jit_once
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, starts_ptr, qlens_ptr, ctxs_ptr, tables_ptr, num_chunks,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_tb,
    qk_scale, window,
    G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, SCAN_C: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    # The chunk: the last one whose first tile (query_start // BLOCK_Q + index) is <= this tile.
    seen = tl.zeros([SCAN_C], dtype=tl.int32)
    for c0 in range(0, num_chunks, SCAN_C):
        offs_c = c0 + tl.arange(0, SCAN_C)
        in_range = offs_c < num_chunks
        first_tile = tl.load(starts_ptr + offs_c, mask=in_range, other=0) // BLOCK_Q + offs_c
        seen += (in_range & (first_tile <= tile)).to(tl.int32)
    chunk = tl.maximum(tl.sum(seen, 0) - 1, 0)  # 0 also for a tile before chunk 0's first: local < 0 below
    q_start = tl.load(starts_ptr + chunk).to(tl.int32)  # positions and rows in int32 (fewer registers)
    q_len = tl.load(qlens_ptr + chunk).to(tl.int32)
    ctx = tl.load(ctxs_ptr + chunk).to(tl.int32)
    local = tile - (q_start // BLOCK_Q + chunk)  # this program's tile within its chunk
    first_q = local * BLOCK_Q  # the tile's first query within the chunk
    has_rows = (local >= 0) & (first_q < q_len)

    offs_m = tl.arange(0, BLOCK_M)  # row = query (m // G) x head (m % G)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < D
    query = first_q + offs_m // G  # within the chunk
    heads = kvh * G + offs_m % G
    row_mask = (offs_m < BLOCK_Q * G) & (query < q_len) & has_rows
    q_pos = ctx - q_len + query  # absolute positions
    rows = (q_start + query).to(tl.int64)  # in the packed batch; times a row stride
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, D_PAD]

    # Keys up to the tile's last query (causal); from its first query's window start with a window.
    end = tl.where(has_rows, tl.minimum(ctx - q_len + first_q + BLOCK_Q, ctx), 0)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(ctx - q_len + first_q - window + 1, 0)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # online softmax state (flash_step.online_softmax)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    table_row = tables_ptr + chunk * stride_tb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        slots = cache_slots(table_row, offs_n, valid, BLOCK_SIZE)  # [BLOCK_N]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0
        )  # [BLOCK_N, D_PAD]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        allowed = valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        v = tl.load(
            v_ptr + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0
        )
        m_i, l_i, acc = online_softmax(s, v, m_i, l_i, acc, PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: dict[str, torch.Tensor],
    block_tables: torch.Tensor,
    block_size: int,
) -> None:
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"want q [T, H, D] and caches [slots, Hkv, D]; got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    heads, dim = q.shape[1:]
    if k_cache.shape[2] != dim or heads % k_cache.shape[1] != 0:
        raise ValueError(
            f"q {tuple(q.shape)} does not match the cache's [slots, Hkv, D] {tuple(k_cache.shape)}"
        )
    index_dtypes = (torch.int32, torch.int64)  # the engine packs its step metadata in int64
    chunks = metadata["query_start"].shape[0] if metadata["query_start"].dim() == 1 else -1
    for name, t in metadata.items():
        if t.shape != (chunks,) or t.dtype not in index_dtypes or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32/int64 [N], got {t.dtype} {tuple(t.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != chunks or block_tables.dtype not in index_dtypes:
        raise ValueError(
            f"block_tables must be int32/int64 [N={chunks}, W], got {block_tables.dtype} "
            f"{tuple(block_tables.shape)}"
        )
    if block_size < 1 or k_cache.shape[0] % block_size != 0:
        raise ValueError(f"block_size {block_size} must divide the cache's {k_cache.shape[0]} slots")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or block_tables.stride(1) != 1:
        raise ValueError("q, the caches and block_tables need a contiguous last dimension")


def launch_config(group: int, dim: int, block_m: int | None, block_n: int | None) -> dict[str, int]:
    """The kernel's shape constants and warps for G query heads per kv head and head_dim `dim` (None: the
    defaults). 64 rows (8 queries x 8 heads on bench-1b) and 64 keys a step: 132 registers and no spills
    for sm90 in bf16 (tests/engine/sm90_compile_attention.py); a guess for speed until bench --sweep runs."""
    if block_m is None:
        block_m = max(64, next_power_of_2(group))
    if block_n is None:
        block_n = 64
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of 2 >= 16, got {value}")
    if block_m < group:
        raise ValueError(f"block_m {block_m} must hold a kv head's {group} query heads")
    d_pad = max(16, next_power_of_2(dim))
    return {
        "G": group, "BLOCK_Q": block_m // group, "BLOCK_M": block_m, "D": dim, "D_PAD": d_pad,
        "BLOCK_N": block_n, "num_warps": 4 if block_m * d_pad <= 64 * 64 else 8,  # 8 from 128 x 64 up
    }  # fmt: skip


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D], any row strides
    k_cache: torch.Tensor,  # [num_blocks * block_size, Hkv, D]
    v_cache: torch.Tensor,
    *,
    query_start: torch.Tensor,  # [N] int32/int64: each chunk's first row in q, ascending, no overlaps
    query_len: torch.Tensor,  # [N] its rows (1 for a decode row)
    context_len: torch.Tensor,  # [N] cached + new positions; >= query_len
    block_tables: torch.Tensor,  # [N, W]; columns past a context's blocks are never read
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,  # [T, H, D] in q's dtype, any row strides
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v per chunk, causal over absolute positions (bottom-right aligned), fp32
    softmax, output in q's dtype. Rows of q outside every chunk are left as they are in `out`.

    `block_m` (query rows x heads per program, a power of 2 >= 16 and >= G) and `block_n` (keys per inner
    step, a power of 2 >= 16) are tuning knobs. Graph-safe: nothing here reads a tensor's values.
    """
    require_triton()
    metadata = {"query_start": query_start, "query_len": query_len, "context_len": context_len}
    _check(q, k_cache, v_cache, metadata, block_tables, block_size)
    tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} with a contiguous last dimension")
    chunks = query_start.shape[0]
    if tokens == 0 or chunks == 0:
        return out
    config = launch_config(group, dim, block_m, block_n)
    block_q = config["BLOCK_Q"]
    # chunk c's last tile is query_start[c] // block_q + c + cdiv(query_len[c], block_q) - 1, at most
    # cdiv(query_start[c] + query_len[c], block_q) + c - 1 <= cdiv(T, block_q) + N - 2
    grid = (cdiv(tokens, block_q) + chunks - 1, kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, query_start, query_len, context_len, block_tables, chunks,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0),
        scale * LOG2E, 0 if sliding_window is None else sliding_window,
        **config, BLOCK_SIZE=block_size, HAS_WINDOW=sliding_window is not None, SCAN_C=SCAN,
        PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    return out
