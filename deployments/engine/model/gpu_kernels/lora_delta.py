"""The multi-LoRA delta of a projection group in one launch: shrink and expand fused, h never in memory.

y[t, cols(p)] += (x[t] @ a[slot(t)][:, p*R:(p+1)*R]) @ b[slot(t), :, cols(p)] for each member p, over tokens
sorted by slot, with lora_sgmv.py's conventions (seg_ends [S] cumulative ends read on the device; rows from
seg_ends[S-1] on carry no adapter and are left untouched; fp32 accumulation; h rounded to the adapters'
dtype before the expand and the delta to y's before the add, as the two-launch pair and the torch path do).

Work split. A program owns one row tile of one slot's segment and one column chunk of one member: it
computes its tile's h for that member only (BLOCK_M x K times K x R: K x R of A read, cheap at rank <= 64)
and adds h @ B into its chunk's columns. Decode thus runs about one program per SM instead of one per slot
(the shrink's old grid streamed each slot's A alone on 16 SMs), and a group costs one launch instead of two.
- Rows: tiles are numbered slot by slot, each segment cut in BLOCK_M rows, so no tile spans two slots and
  none is empty. Their number is at most T // BLOCK_M + min(S, T) whatever the split, so the grid comes
  from shapes only (graph-safe) and prefill launches no program per (slot, row block) pair that has no
  rows; each program finds its slot and first row from seg_ends (a cumulative count of tiles per slot).
- Columns: chunks of `columns` (a multiple of BLOCK_N) within one member, walked BLOCK_N at a time. More
  chunks mean more programs but more reads of A (decode) or of the x tile (prefill): `delta_config` picks
  the chunk by a small cost model, the waves of programs times the bytes one program reads.
Chunks vary fastest in the grid, so the programs that share a tile (its x rows, its slot's A) run together
and hit L2.
- Pages: an adapter wider than one page (lora_layers.py) is a run of consecutive pages; `runs` (on the
  device, beside the segments) gives each run's length, and a program reads its run's rank units page by
  page (A columns and B rows at the page stride) into one h, the whole run in one tile (BLOCK_R covers
  the widest run), so the delta is one h @ B over the run's rank, as the C++ kernel computes it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from deployments.engine.model.gpu_kernels._triton import (
    cdiv,
    dot_precision,
    jit,
    next_power_of_2,
    require_triton,
    tl,
)
from deployments.engine.model.gpu_kernels.lora_sgmv import (
    MAX_FUSED_MEMBERS,
    add_delta,
    check_segments,
    run_units,
    shrink_tile,
)

DECODE_TOKENS = 256  # up to this many tokens a step is a decode batch: few rows per slot
STAGE_BYTES = 64 * 1024  # shared memory for the pipelined x and A tiles
DEFAULT_SMS = 132  # H100/H200; where no CUDA device exists (the interpreter) the count only shapes the grid


@jit
def _tile_of_program(ends_ptr, S, tile, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    """Row tile number `tile`'s slot, first row and segment end; slot >= S when the tile holds no rows."""
    offs = tl.arange(0, BLOCK_S)
    in_range = offs < S
    ends = tl.load(ends_ptr + offs, mask=in_range, other=0)
    starts = tl.load(ends_ptr + offs - 1, mask=in_range & (offs > 0), other=0)
    counts = (tl.maximum(ends - starts, 0) + BLOCK_M - 1) // BLOCK_M  # tiles per slot
    firsts = tl.cumsum(counts, 0) - counts  # each slot's first tile
    slot = tl.sum((firsts + counts <= tile).to(tl.int32), 0)  # the slots wholly before this tile
    mine = offs == slot
    row0 = tl.sum(tl.where(mine, starts + (tile - firsts) * BLOCK_M, 0), 0)
    end = tl.sum(tl.where(mine, ends, 0), 0)
    return slot, row0, end


@jit
def _pick(member, v0, v1, v2, v3):
    """v[member] for a member index in 0..3 (scalars)."""
    return tl.where(member == 0, v0, tl.where(member == 1, v1, tl.where(member == 2, v2, v3)))


@jit
def _delta_kernel(
    x_ptr, a_ptr, b_ptr, ends_ptr, runs_ptr, y_ptr, stride_xt, stride_as, stride_ak, stride_bs, stride_br,
    stride_yt, T, K, R, S, N, col_end0, col_end1, col_end2, chunk_end0, chunk_end1, chunk_end2,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    COLUMNS: tl.constexpr, BLOCK_S: tl.constexpr, PRECISION_A: tl.constexpr, PRECISION_B: tl.constexpr,
    RUNS: tl.constexpr,
):  # fmt: skip
    slot, row0, end = _tile_of_program(ends_ptr, S, tl.program_id(1), BLOCK_M, BLOCK_S)
    if slot < S:
        chunk = tl.program_id(0)
        # Member ends past the last member are N (columns) and the grid's width (chunks): never reached.
        member = (
            (chunk >= chunk_end0).to(tl.int32)
            + (chunk >= chunk_end1).to(tl.int32)
            + (chunk >= chunk_end2).to(tl.int32)
        )
        first_chunk = _pick(member, 0, chunk_end0, chunk_end1, chunk_end2)
        col0 = _pick(member, 0, col_end0, col_end1, col_end2) + (chunk - first_chunk) * COLUMNS
        col_end = tl.minimum(col0 + COLUMNS, _pick(member, col_end0, col_end1, col_end2, N))

        rows = row0 + tl.arange(0, BLOCK_M)
        row_mask = (rows < end) & (rows < T)
        run_rank = R
        if RUNS:  # the adapter's run of pages from its slot on, its rank units side by side
            run_rank = tl.load(runs_ptr + slot).to(tl.int32) * R
        # h = x[rows] @ the run's A columns of this member, fp32, rounded to the adapters' dtype
        a_base = a_ptr + slot.to(tl.int64) * stride_as + member * R
        acc = shrink_tile(
            x_ptr, a_base, rows, row_mask, stride_xt, stride_ak, K, R, run_rank, stride_as,
            BLOCK_M, BLOCK_K, BLOCK_R, PRECISION_A,
        )  # fmt: skip
        h = acc.to(b_ptr.dtype.element_ty)

        page, unit, r_mask = run_units(R, run_rank, BLOCK_R)
        b_rows = page * stride_bs + unit * stride_br  # the run's B rows, page by page
        b_base = b_ptr + slot.to(tl.int64) * stride_bs
        for n0 in range(col0, col_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < col_end
            b = tl.load(
                b_base + b_rows[:, None] + offs_n[None, :],
                mask=r_mask[:, None] & n_mask[None, :],
                other=0.0,
            )
            delta = tl.dot(h, b, input_precision=PRECISION_B)  # [BLOCK_M, BLOCK_N] fp32
            add_delta(y_ptr, rows, row_mask, offs_n, n_mask, stride_yt, delta)


@dataclass(frozen=True)
class DeltaConfig:
    """One launch's blocks. `columns`: the columns one program covers (a multiple of block_n)."""

    block_m: int
    block_k: int
    block_n: int
    columns: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class DeltaShape:
    """What the launch configuration depends on: shapes, dtypes' sizes and the device, never values."""

    tokens: int
    slots: int
    widths: tuple[int, ...]
    k: int
    rank: int
    x_bytes: int  # per element
    w_bytes: int  # the adapters'
    y_bytes: int
    sms: int


def row_tiles(tokens: int, slots: int, block_m: int) -> int:
    """A bound on the non-empty (slot, row tile) pairs of any split of `tokens` among `slots`: each slot's
    tiles number at most its rows // block_m + 1 when it has rows, and at most min(slots, tokens) do."""
    return tokens // block_m + min(slots, tokens)


def chunks_of(widths: tuple[int, ...], columns: int) -> list[int]:
    return [cdiv(w, columns) for w in widths]


@functools.cache
def delta_config(shape: DeltaShape) -> DeltaConfig:
    """Blocks for decode (few rows per slot: 16-row tiles, long K steps, since A's bytes dominate) and
    prefill (64-row tiles); the column chunk by the cost model in the module's docstring."""
    decode = shape.tokens <= DECODE_TOKENS
    block_m, block_n = (16, 128) if decode else (64, 128)
    block_k = min(256 if decode else 64, max(16, next_power_of_2(shape.k)))
    # Decode: about one program an SM streams its slot's A, so keep more of it in flight (4 stages of
    # x and A tiles, 48 KiB of shared memory in bf16). Not measured yet: bench.gpu_kernels --sweep.
    stages = 4 if decode else 3
    block_r = max(16, next_power_of_2(shape.rank))
    while (
        block_k > 16 and stages * block_k * (block_m * shape.x_bytes + block_r * shape.w_bytes) > STAGE_BYTES
    ):
        block_k //= 2  # fp32 or rank 64: shorter K steps, so the stages fit any sm80+ GPU's shared memory
    tiles = row_tiles(shape.tokens, shape.slots, block_m)
    rows = min(block_m, cdiv(shape.tokens, min(shape.slots, shape.tokens)))  # a tile's rows, on average
    s = shape
    best: tuple[float, int] | None = None
    columns = block_n
    while True:
        chunks = sum(chunks_of(s.widths, columns))
        width = sum(s.widths) / chunks  # a program's columns, on average
        reads = s.k * s.rank * s.w_bytes + rows * s.k * s.x_bytes  # its A columns and x tile
        per_program = reads + s.rank * width * s.w_bytes + 2 * rows * width * s.y_bytes  # B, y in and out
        cost = cdiv(tiles * chunks, s.sms) * per_program
        if best is None or cost <= best[0]:  # ties: the wider chunk, fewer programs
            best = (cost, columns)
        if columns >= max(s.widths):
            break
        columns *= 2
    return DeltaConfig(block_m, block_k, block_n, columns=best[1], num_stages=stages)


@functools.cache
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def lora_delta(
    x: torch.Tensor,  # [T, K], any row stride
    a: torch.Tensor,  # [S, K, P * R], any slot and K strides (e.g. a view of a wider buffer)
    b: torch.Tensor,  # [S, R, sum(splits)], any slot and R strides
    seg_ends: torch.Tensor,  # [S] int32 or int64
    y: torch.Tensor,  # [T, sum(splits)], any row stride
    *,
    splits: tuple[int, ...],
    runs: torch.Tensor | None = None,  # [S] int32/int64: pages of the adapter whose run starts at each slot
    max_pages: int = 1,  # the widest run
    config: DeltaConfig | None = None,  # tuning (bench.gpu_kernels --sweep); default: delta_config
) -> None:
    """y[t, cols(p)] += ((x[t] @ a[slot(t)][:, p*R:(p+1)*R]) @ b[slot(t), :, cols(p)]) for each member p
    (cols(p) = [sum(splits[:p]), sum(splits[:p+1]))), rows with an adapter only, in one launch (one per
    four members beyond four). x is cast to a's dtype, h to b's, the delta to y's before the add.
    With `runs`, slot s's adapter spans pages s .. s + runs[s] - 1 (R rank units each): its A columns and
    B rows are those pages' side by side, read on the device like the segments (so graphs replay any
    layout); runs[s] <= max_pages, and a slot without tokens is never read."""
    require_triton()
    slots, k, fused_rank = a.shape
    rank, width = b.shape[1], b.shape[2]
    check_segments(seg_ends, slots)
    if runs is not None:
        check_segments(runs, slots, "runs")
    if max_pages < 1 or (runs is None and max_pages != 1):
        raise ValueError(f"max_pages {max_pages} needs runs and must be at least 1")
    if not splits or min(splits) <= 0 or sum(splits) != width or b.shape[0] != slots:
        raise ValueError(
            f"splits {splits} must be positive and sum to b's {width} columns, b [S={slots}, R, N]"
        )
    if fused_rank != len(splits) * rank or a.stride(2) != 1 or b.stride(2) != 1:
        raise ValueError(
            f"a must be [S, K, {len(splits)} x R={rank}] and b [S, R, N], last dimensions contiguous"
        )
    tokens = x.shape[0]
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x must be [T, {k}] with a contiguous last dimension")
    if y.shape != (tokens, width) or y.stride(1) != 1:
        raise ValueError(f"y must be [{tokens}, {width}] with a contiguous last dimension")
    if len(splits) > MAX_FUSED_MEMBERS:  # member bounds are kernel arguments: four members a launch
        done, col = MAX_FUSED_MEMBERS, sum(splits[:MAX_FUSED_MEMBERS])
        head, tail = splits[:done], splits[done:]
        for cols, members, part in ((slice(None, col), slice(None, done * rank), head),
                                    (slice(col, None), slice(done * rank, None), tail)):  # fmt: skip
            lora_delta(
                x, a[:, :, members], b[:, :, cols], seg_ends, y[:, cols],
                splits=part, runs=runs, max_pages=max_pages, config=config,
            )  # fmt: skip
        return
    if tokens == 0 or slots == 0:
        return
    if config is None:
        config = delta_config(
            DeltaShape(tokens, slots, tuple(splits), k, max_pages * rank, x.element_size(), b.element_size(),
                       y.element_size(), sm_count(x.device))
        )  # fmt: skip
    elif config.columns % config.block_n:
        raise ValueError(f"columns {config.columns} must be a multiple of block_n {config.block_n}")
    chunks = chunks_of(tuple(splits), config.columns)
    col_ends = [sum(splits[: p + 1]) for p in range(len(splits))]
    chunk_ends = [sum(chunks[: p + 1]) for p in range(len(splits))]
    total = chunk_ends[-1]
    pad = MAX_FUSED_MEMBERS - 1
    grid = (total, row_tiles(tokens, slots, config.block_m))
    _delta_kernel[grid](
        x, a, b, seg_ends, seg_ends if runs is None else runs, y, x.stride(0), a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), y.stride(0), tokens, k, rank, slots, width,
        *(col_ends[:-1] + [width] * pad)[:pad], *(chunk_ends[:-1] + [total] * pad)[:pad],
        BLOCK_M=config.block_m, BLOCK_K=config.block_k, BLOCK_R=max(16, next_power_of_2(max_pages * rank)),
        BLOCK_N=config.block_n, COLUMNS=config.columns, BLOCK_S=max(16, next_power_of_2(slots)),
        PRECISION_A=dot_precision(a.dtype), PRECISION_B=dot_precision(b.dtype), RUNS=runs is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
