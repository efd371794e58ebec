"""Paged attention over a packed ragged batch, for our decoder forward and for HF model classes.

A step is one "sequence" of T tokens holding every running request's new tokens, with absolute positions.
The new K/V go into the engine's paged cache first; then each request attends over its own context only:
- decode requests (one new token) in one batched call: a paged kernel that reads the block tables (CUDA),
  or SDPA over K/V gathered from their blocks, padded to the widest context and masked (CPU);
- prefill chunks one SDPA call each, with a bottom-right-aligned causal mask (SDPA's is_causal is
  top-left aligned, wrong once cached tokens precede the chunk).
With a paged prefill kernel (CUDA) a step that is not pure decode instead describes every sequence as one
chunk (`StepChunks`; a decode row is a chunk of one token) and attends in one launch per layer, reading the
block tables directly: no per-span call, mask or gather, whatever the number of prompts.
Models our forward does not cover run HF's modules, which reach `paged_attention` through transformers'
AttentionInterface with the step metadata as a kwarg.
"""

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "loraplex_paged"
METADATA_KWARG = "loraplex_attn"


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's chunk of several new tokens."""

    start: int  # first token of the chunk in the packed batch
    length: int  # new tokens in the chunk
    context_len: int  # tokens attended to: cached + new
    blocks: torch.Tensor | None  # [ceil(context_len / block_size)] block ids; None when nothing is cached yet


@dataclass(slots=True)
class StepChunks:
    """Every sequence of a step as one chunk of the packed batch (views of the step's device buffer)."""

    query_start: torch.Tensor  # [N] first row of each chunk, ascending
    query_len: torch.Tensor  # [N] new tokens (1 for a decode row)
    context_len: torch.Tensor  # [N] cached + new
    block_tables: torch.Tensor  # [N, W] block ids; columns past a context's blocks are stale, never read


@dataclass(slots=True)
class AttentionMetadata:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V [num_blocks * block_size, Hkv, D]
    block_size: int
    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    decode_token_index: torch.Tensor | None  # [Nd] where each decode token sits in the packed batch
    decode_block_table: torch.Tensor | None  # [Nd, W] block ids of each context, padded with block 0
    decode_context_lens: torch.Tensor | None  # [Nd]
    prefills: list[PrefillSpan]
    all_decode: bool = False  # every token is a decode row, in order (decode_token_index is then None)
    decode_width: int = 0  # table columns a gathered context needs (host-known; the CPU path's width)
    chunks: StepChunks | None = (
        None  # set instead of the decode and prefill fields for a paged prefill kernel
    )
    _masks: dict[tuple[str, int, int | None], torch.Tensor] = field(default_factory=dict)

    def forget_masks(self) -> None:
        self._masks.clear()

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[Nd, 1, 1, W * block_size] True where a decode token may attend (its context, in the window)."""
        key = ("decode", 0, window)
        mask = self._masks.get(key)
        if mask is None:
            assert self.decode_block_table is not None
            assert self.decode_context_lens is not None
            lens = self.decode_context_lens[:, None]  # [Nd, 1]
            width = self.decode_width * self.block_size
            pos = torch.arange(width, device=lens.device)[None, :]  # [1, W * block_size]
            mask = pos < lens
            if window is not None:
                mask &= pos >= lens - window
            mask = self._masks[key] = mask[:, None, None, :]
        return mask

    def prefill_mask(self, index: int, window: int | None) -> torch.Tensor:
        """[length, context_len] bottom-right-aligned causal mask for prefill span `index`."""
        key = ("prefill", index, window)
        mask = self._masks.get(key)
        if mask is None:
            span = self.prefills[index]
            device = self.slot_mapping.device
            q_pos = torch.arange(span.context_len - span.length, span.context_len, device=device)[:, None]
            k_pos = torch.arange(span.context_len, device=device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            self._masks[key] = mask
        return mask


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The HF attention interface (models our own forward does not cover)."""
    meta: AttentionMetadata = kwargs[METADATA_KWARG]
    k_cache, v_cache = meta.kv_caches[module.layer_idx]  # type: ignore[index]
    k_new = key[0].transpose(0, 1)  # [T, Hkv, D]
    v_new = value[0].transpose(0, 1)
    k_cache.index_copy_(0, meta.slot_mapping, k_new)
    v_cache.index_copy_(0, meta.slot_mapping, v_new)
    q = query[0].transpose(0, 1)  # [T, H, D]
    out = attend(q, k_new, v_new, k_cache, v_cache, meta, scale=scaling, window=sliding_window)
    return out.unsqueeze(0), None


def attend(
    q: torch.Tensor,  # [T, H, D], rotated
    k_new: torch.Tensor,  # [T, Hkv, D], rotated, already in the cache
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float | None,
    window: int | None,
    paged: "PagedDecode | None" = None,
    paged_prefill: "PagedPrefill | None" = None,
) -> torch.Tensor:
    """Each token attends over its own sequence's context: every chunk in one launch of `paged_prefill` when
    the step was built as chunks; otherwise decode rows in one batched call (a paged kernel when `paged` is
    given, else SDPA over gathered contexts) and each prefill chunk in its own SDPA call."""
    if meta.chunks is not None:
        if paged_prefill is None:
            raise RuntimeError("the step was built as chunks for a paged prefill kernel the forward lacks")
        chunks = meta.chunks
        out = torch.empty_like(q)
        paged_prefill(
            q,
            k_cache,
            v_cache,
            query_start=chunks.query_start,
            query_len=chunks.query_len,
            context_len=chunks.context_len,
            block_tables=chunks.block_tables,
            block_size=meta.block_size,
            scale=q.shape[-1] ** -0.5 if scale is None else scale,
            sliding_window=window,
            out=out,
        )
        return out
    if meta.all_decode:
        return decode_attention(q, k_cache, v_cache, meta, scale=scale, window=window, paged=paged)
    out = torch.empty_like(q)  # [T, H, D]
    if meta.decode_token_index is not None:
        q_d = q.index_select(0, meta.decode_token_index)
        o_d = decode_attention(q_d, k_cache, v_cache, meta, scale=scale, window=window, paged=paged)
        out.index_copy_(0, meta.decode_token_index, o_d)
    for i, span in enumerate(meta.prefills):
        q_p = q[span.start : span.start + span.length].transpose(0, 1)[None]  # [1, H, n, D]
        if span.blocks is None:  # nothing cached before the chunk: attend to the new K/V directly
            k_p = k_new[span.start : span.start + span.length].transpose(0, 1)[None]
            v_p = v_new[span.start : span.start + span.length].transpose(0, 1)[None]
        else:
            blocks = span.blocks[None]
            k_p = _gather_blocks(k_cache, blocks, meta.block_size)[:, : span.context_len].transpose(1, 2)
            v_p = _gather_blocks(v_cache, blocks, meta.block_size)[:, : span.context_len].transpose(1, 2)
        if span.blocks is None and window is None:
            o_p = F.scaled_dot_product_attention(q_p, k_p, v_p, is_causal=True, scale=scale, enable_gqa=True)
        else:
            mask = meta.prefill_mask(i, window)
            o_p = F.scaled_dot_product_attention(q_p, k_p, v_p, attn_mask=mask, scale=scale, enable_gqa=True)
        out[span.start : span.start + span.length] = o_p[0].transpose(0, 1)
    return out


class PagedDecode(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        *,
        block_size: int,
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor,
    ) -> None: ...


class PagedPrefill(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        query_start: torch.Tensor,
        query_len: torch.Tensor,
        context_len: torch.Tensor,
        block_tables: torch.Tensor,
        block_size: int,
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor,
    ) -> None: ...


def decode_attention(
    q: torch.Tensor,  # [Nd, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float | None,
    window: int | None,
    paged: PagedDecode | None = None,
) -> torch.Tensor:
    """[Nd, H, D]: one new token per sequence over its cached context."""
    assert meta.decode_block_table is not None and meta.decode_context_lens is not None
    if paged is not None:
        out = torch.empty_like(q)
        paged(
            q,
            k_cache,
            v_cache,
            meta.decode_block_table,
            meta.decode_context_lens,
            block_size=meta.block_size,
            scale=q.shape[-1] ** -0.5 if scale is None else scale,
            sliding_window=window,
            out=out,
        )
        return out
    table = meta.decode_block_table[:, : meta.decode_width]
    k_d = _gather_blocks(k_cache, table, meta.block_size).transpose(1, 2)  # [Nd, Hkv, L, D]
    v_d = _gather_blocks(v_cache, table, meta.block_size).transpose(1, 2)
    o_d = F.scaled_dot_product_attention(
        q.unsqueeze(2), k_d, v_d, attn_mask=meta.decode_mask(window), scale=scale, enable_gqa=True
    )  # [Nd, H, 1, D]
    return o_d.squeeze(2)


def _gather_blocks(cache: torch.Tensor, table: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N, W * block_size, Hkv, D] from a block table [N, W]: whole blocks are copied, not single tokens."""
    blocks = cache.view(-1, block_size, *cache.shape[1:])  # [num_blocks, block_size, Hkv, D]
    return blocks.index_select(0, table.flatten()).view(table.shape[0], -1, *cache.shape[1:])


def register_paged_attention() -> str:
    """Register once per process (idempotent); returns the attn_implementation name to load models with."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    return ATTN_IMPLEMENTATION
