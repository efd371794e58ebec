"""StepInputs: one step's tensors, built on the host in one pinned buffer and copied to the device once.

Every index the forward reads (token ids, positions, KV slots, logits rows, decode block tables and context
lengths, prefill block lists, LoRA segment ends; or, for a forward with a paged prefill kernel, every
sequence's chunk: first row, length, context length, block table) is written with numpy into one int64
host buffer, laid out back to back, and moved with a single non-blocking copy; the forward sees views of
the device twin. Nothing in the forward reads a value back to the host.

Pure-decode steps of up to `max_num_seqs` sequences instead use a fixed layout per batch bucket (1, 2, 4, 8,
...): the same views at the same device addresses every step, which is what a captured CUDA graph replays.
Bucket rows beyond the batch are padding: they read token 0 at position 0, write their K/V into the cache's
sink slot (never allocated to a sequence) and attend only to it; their logits are dropped.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from deployments.engine.logprobs import prompt_positions
from deployments.engine.model.attention import AttentionMetadata, PrefillSpan, StepChunks
from deployments.engine.model.kv_cache import KVCache
from deployments.engine.model.lora_kernels import LoRABatch, lora_batch
from deployments.engine.sequence import ScheduledSequence


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat KV slot each new token is written to
    logits_index: torch.Tensor | None  # [N] token rows whose logits are kept; None: every row
    attention: AttentionMetadata
    lora: LoRABatch | None  # None when no token of the step carries an adapter
    lora_ends: torch.Tensor  # [lora_pages] the step's round-0 segment ends on the device (LoRABatch.offsets)
    lora_runs: torch.Tensor  # [lora_pages] each adapter's pages at its slot, on the device (LoRABatch.runs)
    num_rows: int  # logits rows the step needs: the real (unpadded) rows of a decode bucket


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes a decode step is padded to: powers of two, then max_num_seqs itself."""
    sizes = [1]
    while sizes[-1] < max_num_seqs:
        sizes.append(min(sizes[-1] * 2, max_num_seqs))
    return sizes


def is_pure_decode(scheduled: list[ScheduledSequence]) -> bool:
    """Every sequence adds one token and samples from it, and none collects prompt logprobs."""
    return all(s.num_tokens == 1 and s.draws and not s.seq.collects_prompt_logprobs for s in scheduled)


_View = Callable[[int, int], torch.Tensor]  # (offset, count) -> a view of the step's device buffer
_AttentionViews = Callable[[_View, torch.Tensor], AttentionMetadata]  # (views, slot_mapping) -> metadata


class _Layout:
    """A general step's fields back to back in the host buffer: where each starts, and its numpy view."""

    def __init__(self, host: npt.NDArray[np.int64]) -> None:
        self.host = host
        self.cursor = 0

    def take(self, count: int) -> tuple[int, npt.NDArray[np.int64]]:
        at = self.cursor
        self.cursor += count
        return at, self.host[at : self.cursor]


class StepInputsBuilder:
    def __init__(
        self,
        kv_cache: KVCache,
        *,
        device: torch.device,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        lora_pages: int,
        lora_run_pages: int = 1,
        chunked: bool = False,
    ) -> None:
        """`chunked`: general steps describe every sequence as one chunk (StepChunks) for a forward whose
        attention has a paged prefill kernel, instead of decode rows and prefill spans (the SDPA path).
        `lora_run_pages`: the most pages one adapter spans."""
        self.kv_cache = kv_cache
        self.chunked = chunked
        self.device = device
        self.block_size = kv_cache.block_size
        self.lora_pages = lora_pages
        self.lora_run_pages = lora_run_pages
        self.max_blocks = -(-max_model_len // self.block_size)  # block-table width that fits any sequence
        self.buckets = decode_buckets(max_num_seqs)
        tokens = max(max_num_batched_tokens, max_num_seqs)
        seqs = max_num_seqs
        # General steps: 4 per token (ids, positions, slots, logits rows), LoRA ends and runs, and either 2
        # per decode row plus its table and the prefill block lists (at most a full table per sequence), or
        # 3 per chunk plus its table.
        attention = seqs * (3 + self.max_blocks) if chunked else seqs * (2 + 2 * self.max_blocks)
        general = 4 * tokens + attention + 2 * lora_pages
        bucket = self._bucket_size(self.buckets[-1])
        cuda = device.type == "cuda"
        self._host = torch.zeros(max(general, bucket), dtype=torch.int64, pin_memory=cuda)
        self._np = self._host.numpy()
        # On the CPU the host buffer is the device buffer; on CUDA each layout has its own device twin, so
        # the decode buckets' views never move.
        self._general = torch.zeros(general, dtype=torch.int64, device=device) if cuda else self._host
        self._bucket = torch.zeros(bucket, dtype=torch.int64, device=device) if cuda else self._host
        self._copied = torch.cuda.Event() if cuda else None  # type: ignore[no-untyped-call]  # the last copy out of the host buffer
        self._bucket_views: dict[int, StepInputs] = {}
        self.pad_cpu_buckets = False  # tests pad CPU decode steps too, to exercise the padded rows

    @property
    def nbytes(self) -> int:
        """Host and device buffers together (the memory plan counts them)."""
        buffers = {id(b): b for b in (self._host, self._general, self._bucket)}
        return sum(b.nbytes for b in buffers.values())

    # -- decode buckets -------------------------------------------------------------------------------

    def _bucket_size(self, b: int) -> int:
        return 4 * b + 2 * self.lora_pages + b * self.max_blocks

    def bucket_for(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def bucket_inputs(self, bucket: int) -> StepInputs:
        """The fixed views of one decode bucket (made once; a captured graph reads exactly these)."""
        inputs = self._bucket_views.get(bucket)
        if inputs is None:
            inputs = self._bucket_views[bucket] = self._bucket_layout(bucket)
        return inputs

    def _bucket_layout(self, b: int) -> StepInputs:
        buf, s, w = self._bucket, self.lora_pages, self.max_blocks
        ids, positions, slots, lens = (buf[i * b : (i + 1) * b] for i in range(4))
        ends = buf[4 * b : 4 * b + s]
        runs = buf[4 * b + s : 4 * b + 2 * s]
        tables = buf[4 * b + 2 * s : 4 * b + 2 * s + b * w].view(b, w)
        attention = AttentionMetadata(
            kv_caches=self.kv_cache.layers,
            block_size=self.block_size,
            slot_mapping=slots,
            decode_token_index=None,
            decode_block_table=tables,
            decode_context_lens=lens,
            prefills=[],
            all_decode=True,
            decode_width=w,
        )
        return StepInputs(ids, positions, slots, None, attention, None, ends, runs, b)

    def decode(self, scheduled: list[ScheduledSequence], *, pad: bool) -> StepInputs:
        """A pure-decode step in its bucket's fixed views (padded to the bucket when `pad`)."""
        n = len(scheduled)
        b = self.bucket_for(n) if pad else n
        assert b is not None, f"{n} decodes exceed the largest bucket"
        view = self.bucket_inputs(b)
        s, w, bs = self.lora_pages, self.max_blocks, self.block_size
        self._wait_for_last_copy()
        host = self._np
        ids, positions, slots, lens = (host[i * b : (i + 1) * b] for i in range(4))
        ends = host[4 * b : 4 * b + s]
        runs = host[4 * b + s : 4 * b + 2 * s]
        tables = host[4 * b + 2 * s : 4 * b + 2 * s + b * w].reshape(b, w)
        sink_block = self.kv_cache.num_blocks
        cuda = self.device.type == "cuda"
        # Columns past a context must hold valid block ids: the gathered (CPU) path reads up to the widest.
        widest = w if cuda else max(len(item.seq.block_table) for item in scheduled)
        for i, item in enumerate(scheduled):
            seq = item.seq
            pos = seq.num_computed
            table = seq.block_table
            ids[i] = seq.token_ids[pos]
            positions[i] = pos
            slots[i] = table[pos // bs] * bs + pos % bs
            lens[i] = pos + 1
            tables[i, : len(table)] = table
            tables[i, len(table) : widest] = 0
        if b > n:  # padding rows: the sink slot, alone
            ids[n:] = 0
            positions[n:] = 0
            slots[n:] = sink_block * bs
            lens[n:] = 1
            tables[n:, :widest] = sink_block
        lora_tokens = self._segment_ends(scheduled, ends, runs)
        self._copy(self._bucket, 4 * b + 2 * s + b * w)
        view.attention.decode_width = widest
        view.attention.forget_masks()  # the views are reused: masks of the last step no longer hold
        view.lora = self._lora_batch(scheduled, view.lora_ends, view.lora_runs, lora_tokens)
        view.num_rows = n
        return view

    # -- general steps --------------------------------------------------------------------------------

    def general(self, scheduled: list[ScheduledSequence]) -> StepInputs:
        """Any step (prefill chunks, decodes, prompt logprobs), in one copy; views differ step to step."""
        bs = self.block_size
        self._wait_for_last_copy()
        layout = _Layout(self._np)
        lengths = [s.num_tokens for s in scheduled]
        starts = [s.seq.num_computed for s in scheduled]
        t = sum(lengths)
        ids_at, ids = layout.take(t)
        pos_at, positions = layout.take(t)
        slot_at, slots = layout.take(t)
        rows: list[int] = []
        first = 0
        for i, item in enumerate(scheduled):
            seq, n, start = item.seq, lengths[i], starts[i]
            table = seq.block_table
            ids[first : first + n] = seq.token_ids[start : start + n]
            if n == 1:
                positions[first] = start
                slots[first] = table[start // bs] * bs + start % bs
            else:
                p = np.arange(start, start + n)
                positions[first : first + n] = p
                slots[first : first + n] = np.asarray(table, dtype=np.int64)[p // bs] * bs + p % bs
            rows.extend(first + q - start for q in prompt_positions(seq, start, n))
            if item.draws:
                rows.append(first + n - 1)
            first += n
        rows_at, logits_rows = layout.take(len(rows))
        logits_rows[:] = rows
        write = self._write_chunks if self.chunked else self._write_spans
        attention_views = write(scheduled, lengths, starts, layout)
        ends_at, ends = layout.take(self.lora_pages)
        runs_at, runs = layout.take(self.lora_pages)
        lora_tokens = self._segment_ends(scheduled, ends, runs)
        self._copy(self._general, layout.cursor)
        dev = self._general

        def view(at: int, count: int) -> torch.Tensor:
            return dev[at : at + count]

        attention = attention_views(view, view(slot_at, t))
        lora_ends = view(ends_at, self.lora_pages)
        lora_runs = view(runs_at, self.lora_pages)
        return StepInputs(
            input_ids=view(ids_at, t),
            positions=view(pos_at, t),
            slot_mapping=attention.slot_mapping,
            logits_index=view(rows_at, len(rows)),
            attention=attention,
            lora=self._lora_batch(scheduled, lora_ends, lora_runs, lora_tokens),
            lora_ends=lora_ends,
            lora_runs=lora_runs,
            num_rows=len(rows),
        )

    def _write_spans(
        self, scheduled: list[ScheduledSequence], lengths: list[int], starts: list[int], layout: _Layout
    ) -> _AttentionViews:
        """Decode rows (index, context length, block table) and prefill spans (cached blocks), for the split
        path: decode rows batched, one SDPA call per prefill span."""
        bs = self.block_size
        decode_rows: list[int] = []  # packed index of each decode token
        decode_seqs: list[int] = []
        prefill_specs: list[tuple[int, int, int, list[int] | None]] = []
        first = 0
        for i, item in enumerate(scheduled):
            n, start = lengths[i], starts[i]
            if n == 1:
                decode_rows.append(first)
                decode_seqs.append(i)
            else:
                context = start + n
                table = item.seq.block_table
                prefill_specs.append((first, n, context, table[: -(-context // bs)] if start > 0 else None))
            first += n
        nd = len(decode_rows)
        width = max((len(scheduled[i].seq.block_table) for i in decode_seqs), default=0)
        drow_at, drows = layout.take(nd)
        drows[:] = decode_rows
        dlen_at, dlens = layout.take(nd)
        dtab_at, dtab = layout.take(nd * width)
        tables = dtab.reshape(nd, width)
        tables[:] = 0  # padding is block 0; the mask hides it
        for r, i in enumerate(decode_seqs):
            seq = scheduled[i].seq
            dlens[r] = starts[i] + 1
            tables[r, : len(seq.block_table)] = seq.block_table
        spans: list[tuple[int, int, int, int | None, int]] = []
        for start, n, context, cached in prefill_specs:
            if cached is None:
                spans.append((start, n, context, None, 0))
            else:
                at, dst = layout.take(len(cached))
                dst[:] = cached
                spans.append((start, n, context, at, len(cached)))
        all_decode = nd == len(scheduled) == first

        def views(view: _View, slot_mapping: torch.Tensor) -> AttentionMetadata:
            return AttentionMetadata(
                kv_caches=self.kv_cache.layers,
                block_size=bs,
                slot_mapping=slot_mapping,
                decode_token_index=view(drow_at, nd) if nd else None,
                decode_block_table=view(dtab_at, nd * width).view(nd, width) if nd else None,
                decode_context_lens=view(dlen_at, nd) if nd else None,
                prefills=[
                    PrefillSpan(start, n, context, None if at is None else view(at, count))
                    for start, n, context, at, count in spans
                ],
                all_decode=all_decode,
                decode_width=width,
            )

        return views

    def _write_chunks(
        self, scheduled: list[ScheduledSequence], lengths: list[int], starts: list[int], layout: _Layout
    ) -> _AttentionViews:
        """Every sequence as one chunk (first row, length, context, block table), for a paged prefill kernel
        that attends the whole step in one launch. Table columns past a context's blocks are left stale: the
        kernel never reads them."""
        bs, n = self.block_size, len(scheduled)
        start_at, query_start = layout.take(n)
        len_at, query_len = layout.take(n)
        ctx_at, context_len = layout.take(n)
        query_len[:] = lengths
        np.cumsum(query_len, out=query_start)
        query_start -= query_len
        context_len[:] = starts
        context_len += query_len
        need = -(-context_len // bs)
        width = int(need.max(initial=0))
        tab_at, flat = layout.take(n * width)
        tables = flat.reshape(n, width)
        for r, item in enumerate(scheduled):
            k = int(need[r])
            tables[r, :k] = item.seq.block_table[:k]

        def views(view: _View, slot_mapping: torch.Tensor) -> AttentionMetadata:
            chunks = StepChunks(
                query_start=view(start_at, n),
                query_len=view(len_at, n),
                context_len=view(ctx_at, n),
                block_tables=view(tab_at, n * width).view(n, width),
            )
            return AttentionMetadata(
                kv_caches=self.kv_cache.layers,
                block_size=bs,
                slot_mapping=slot_mapping,
                decode_token_index=None,
                decode_block_table=None,
                decode_context_lens=None,
                prefills=[],
                chunks=chunks,
            )

        return views

    # -- shared ---------------------------------------------------------------------------------------

    def _segment_ends(
        self, scheduled: list[ScheduledSequence], ends: npt.NDArray[np.int64], runs: npt.NDArray[np.int64]
    ) -> int:
        """Cumulative token ends per slot, an adapter's first page (the scheduler sorted sequences by slot,
        base last), and each present adapter's pages at its slot (other entries are never read); returns the
        number of tokens that carry an adapter."""
        per_slot = np.zeros(self.lora_pages, dtype=np.int64)
        lora_tokens = 0
        for item in scheduled:
            if item.seq.slot < 0:
                break
            per_slot[item.seq.slot] += item.num_tokens
            runs[item.seq.slot] = item.seq.lora_pages
            lora_tokens += item.num_tokens
        np.cumsum(per_slot, out=ends)
        return lora_tokens

    def _lora_batch(
        self, scheduled: list[ScheduledSequence], offsets: torch.Tensor, runs: torch.Tensor, lora_tokens: int
    ) -> LoRABatch | None:
        if lora_tokens == 0:
            return None
        segments: list[tuple[int, int, int]] = []
        pages: list[int] = []  # each segment's adapter's pages
        cursor = 0
        for item in scheduled:
            slot = item.seq.slot
            if slot < 0:
                break
            if segments and segments[-1][0] == slot:
                segments[-1] = (slot, segments[-1][1], cursor + item.num_tokens)
            else:
                segments.append((slot, cursor, cursor + item.num_tokens))
                pages.append(item.seq.lora_pages)
            cursor += item.num_tokens
        return lora_batch(segments, pages, offsets, lora_tokens, runs=runs, max_pages=self.lora_run_pages)

    def _copy(self, device_buffer: torch.Tensor, count: int) -> None:
        if device_buffer is self._host:
            return
        device_buffer[:count].copy_(self._host[:count], non_blocking=True)
        assert self._copied is not None
        self._copied.record()

    def _wait_for_last_copy(self) -> None:
        """The host buffer is rewritten only after the device has read the previous step's copy (almost
        always long done: each step already waited for its sampled tokens)."""
        if self._copied is not None:
            self._copied.synchronize()
