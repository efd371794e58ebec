"""The multi-LoRA delta over tokens sorted by adapter slot (SGMV): shrink x @ A[slot], expand h @ B[slot].

Segments are read on the device: seg_ends [S] int32 holds each slot's cumulative end (slot s owns rows
[seg_ends[s-1], seg_ends[s]), seg_ends[-1] := 0; an empty slot repeats the previous end; rows from
seg_ends[S-1] on carry no adapter), as LoRABatch.offsets in lora_kernels.py. The grid is (slot, row block,
column block) from shapes only: a program whose row block starts past its slot's segment does nothing, so
one launch serves any split of T tokens among the slots and stays valid inside a captured graph. Rows
without an adapter are left untouched, in h as in y.

The pair takes adapters of one page (bench.gpu_kernels compares it with lora_delta.py, which the engine
runs and which also reads adapters in runs of pages).

Fused projections: one shrink over the members' A matrices concatenated along R (a [S, K, P * R]) gives h
[T, P * R]; one expand adds member p's h columns [p * R, (p + 1) * R) times its B columns into its own y
columns (b [S, R, sum(splits)] holds the members' B side by side).
"""

from __future__ import annotations

import torch

from deployments.engine.model.gpu_kernels._triton import (
    cdiv,
    dot_precision,
    jit,
    next_power_of_2,
    require_triton,
    tl,
)

MAX_FUSED_MEMBERS = 4  # member boundaries are three kernel arguments
BIG = 2**31 - 1  # a boundary no column reaches


@jit
def _segment_rows(ends_ptr, s, BLOCK_M: tl.constexpr):
    """This program's rows of slot s's segment, their mask, and whether the block holds any row at all."""
    start = tl.load(ends_ptr + tl.maximum(s - 1, 0))
    start = tl.where(s > 0, start, 0)
    end = tl.load(ends_ptr + s)
    row0 = start + tl.program_id(1) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    return rows, rows < end, row0 < end


@jit
def run_units(R, run_rank, BLOCK_R: tl.constexpr):
    """Rank unit u of a run of pages (lora_layers.py: an adapter wider than one page takes consecutive
    pages) is unit u % R of page u // R; the mask keeps the units the run has."""
    offs_r = tl.arange(0, BLOCK_R)
    return offs_r // R, offs_r % R, offs_r < run_rank


@jit
def shrink_tile(
    x_ptr, a_base, rows, row_mask, stride_xt, stride_ak, K, R, run_rank, stride_ap,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """x[rows] @ A [K, run_rank] in fp32, x cast to A's dtype. a_base: the run's first element; each page
    holds R contiguous columns, pages stride_ap apart (run_rank == R: one page, the stride unused)."""
    page, unit, r_mask = run_units(R, run_rank, BLOCK_R)
    a_cols = page * stride_ap + unit
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xt + offs_k[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        a = tl.load(
            a_base + offs_k[:, None] * stride_ak + a_cols[None, :],
            mask=k_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        acc += tl.dot(x.to(a.dtype), a, input_precision=PRECISION)
    return acc


@jit
def add_delta(y_ptr, rows, row_mask, offs_n, n_mask, stride_yt, delta):
    """y[rows, offs_n] += delta, the fp32 delta rounded to y's dtype first (as `y += delta.to(y.dtype)`)."""
    y_ptrs = y_ptr + rows[:, None] * stride_yt + offs_n[None, :]
    tile_mask = row_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=tile_mask, other=0.0)
    y = (y.to(tl.float32) + delta.to(y.dtype).to(tl.float32)).to(y.dtype)
    tl.store(y_ptrs, y, mask=tile_mask)


@jit
def _shrink_kernel(
    x_ptr, a_ptr, ends_ptr, h_ptr, stride_xt, stride_as, stride_ak, stride_ht, K, R,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    rows, row_mask, live = _segment_rows(ends_ptr, s, BLOCK_M)
    if live:
        a_base = a_ptr + s.to(tl.int64) * stride_as
        acc = shrink_tile(
            x_ptr, a_base, rows, row_mask, stride_xt, stride_ak, K, R, R, stride_as,
            BLOCK_M, BLOCK_K, BLOCK_R, PRECISION,
        )  # fmt: skip
        offs_r = tl.arange(0, BLOCK_R)
        tl.store(
            h_ptr + rows[:, None] * stride_ht + offs_r[None, :],
            acc,
            mask=row_mask[:, None] & (offs_r < R)[None, :],
        )


@jit
def _expand_kernel(
    h_ptr, b_ptr, ends_ptr, y_ptr, stride_ht, stride_bs, stride_br, stride_yt, R, N, end0, end1, end2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    rows, row_mask, live = _segment_rows(ends_ptr, s, BLOCK_M)
    if live:
        n0 = tl.program_id(2) * BLOCK_N
        # BLOCK_N divides every member's width, so the whole column block belongs to one member.
        member = (n0 >= end0).to(tl.int32) + (n0 >= end1).to(tl.int32) + (n0 >= end2).to(tl.int32)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        h = tl.load(
            h_ptr + rows[:, None] * stride_ht + member * R + offs_r[None, :],
            mask=row_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + s.to(tl.int64) * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :],
            mask=r_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        delta = tl.dot(h.to(b.dtype), b, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] fp32
        add_delta(y_ptr, rows, row_mask, offs_n, n_mask, stride_yt, delta)


def _block_m(tokens: int) -> int:
    return 16 if tokens <= 256 else 64


INDEX_DTYPES = (torch.int32, torch.int64)  # the engine packs its step metadata in int64


def check_segments(seg_ends: torch.Tensor, slots: int, name: str = "seg_ends") -> None:
    """A per-slot index tensor read on the device (the segment ends, or lora_delta's run lengths)."""
    if seg_ends.shape != (slots,) or seg_ends.dtype not in INDEX_DTYPES or not seg_ends.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous int32/int64 [S={slots}], got {seg_ends.dtype} {seg_ends.shape}"
        )


def lora_shrink(
    x: torch.Tensor,  # [T, K], any row stride
    a: torch.Tensor,  # [S, K, R], any slot and K strides (e.g. R columns of a wider buffer)
    seg_ends: torch.Tensor,  # [S] int32 or int64
    h: torch.Tensor,  # [T, R] fp32, any row stride
) -> None:
    """h[t] = x[t] @ a[slot(t)] in fp32 (x cast to a's dtype) for rows with an adapter; others untouched."""
    require_triton()
    slots, k, rank = a.shape
    check_segments(seg_ends, slots)
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or a.stride(2) != 1:
        raise ValueError(f"want x [T, K={k}] and a [S, K, R] with contiguous last dimensions")
    if h.shape != (x.shape[0], rank) or h.dtype != torch.float32 or h.stride(1) != 1:
        raise ValueError(f"h must be float32 [{x.shape[0]}, {rank}] with a contiguous last dimension")
    tokens = x.shape[0]
    if tokens == 0 or slots == 0:
        return
    block_m = _block_m(tokens)
    _shrink_kernel[(slots, cdiv(tokens, block_m))](
        x, a, seg_ends, h, x.stride(0), a.stride(0), a.stride(1), h.stride(0), k, rank,
        BLOCK_M=block_m, BLOCK_K=min(128, max(16, next_power_of_2(k))),
        BLOCK_R=max(16, next_power_of_2(rank)), PRECISION=dot_precision(a.dtype), num_warps=4,
    )  # fmt: skip


def _fused_block_n(splits: tuple[int, ...]) -> int | None:
    """The widest column block that divides every member, so no block straddles two members."""
    if len(splits) > MAX_FUSED_MEMBERS:
        return None
    return next((n for n in (128, 64, 32, 16) if all(w % n == 0 for w in splits)), None)


def _launch_expand(
    h: torch.Tensor, b: torch.Tensor, seg_ends: torch.Tensor, y: torch.Tensor, ends: list[int], block_n: int
) -> None:
    tokens, width = y.shape
    slots, rank = b.shape[0], b.shape[1]
    block_m = _block_m(tokens)
    bounds = [*ends[:-1], BIG, BIG, BIG][:3]  # the first three member ends; the last member runs to N
    _expand_kernel[(slots, cdiv(tokens, block_m), cdiv(width, block_n))](
        h, b, seg_ends, y, h.stride(0), b.stride(0), b.stride(1), y.stride(0), rank, width, *bounds,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=max(16, next_power_of_2(rank)),
        PRECISION=dot_precision(b.dtype), num_warps=4,
    )  # fmt: skip


def lora_expand(
    h: torch.Tensor,  # [T, P * R] fp32 (P = len(splits)), any row stride
    b: torch.Tensor,  # [S, R, sum(splits)], any slot and R strides
    seg_ends: torch.Tensor,  # [S] int32 or int64
    y: torch.Tensor,  # [T, sum(splits)], any row stride
    *,
    splits: tuple[int, ...],
) -> None:
    """y[t, cols(p)] += (h[t, p*R:(p+1)*R] @ b[slot(t), :, cols(p)]) rounded to y's dtype, for every member
    p (cols(p) = [sum(splits[:p]), sum(splits[:p+1]))), rows with an adapter only. One launch when a column
    block divides every member's width (and at most 4 members), else one per member."""
    require_triton()
    slots, rank, width = b.shape
    check_segments(seg_ends, slots)
    if not splits or min(splits) <= 0 or sum(splits) != width or b.stride(2) != 1:
        raise ValueError(f"splits {splits} must be positive and sum to b's {width} columns")
    tokens = y.shape[0]
    if y.shape != (tokens, width) or y.stride(1) != 1:
        raise ValueError(f"y must be [T, {width}] with a contiguous last dimension")
    if h.dim() != 2 or h.shape[0] != tokens or h.shape[1] < len(splits) * rank or h.dtype != torch.float32:
        raise ValueError(f"h must be float32 [{tokens}, {len(splits) * rank}]")
    if h.stride(1) != 1:
        raise ValueError("h needs a contiguous last dimension")
    if tokens == 0 or slots == 0:
        return
    ends = [sum(splits[: p + 1]) for p in range(len(splits))]
    block_n = _fused_block_n(splits)
    if block_n is not None:
        _launch_expand(h, b, seg_ends, y, ends, block_n)
        return
    for p, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        _launch_expand(
            h[:, p * rank : (p + 1) * rank], b[:, :, start:end], seg_ends, y[:, start:end], [end - start], 64
        )
