"""Paged attention for HF model classes, over a packed ragged batch.

The model sees one "sequence" of T tokens (input_ids [1, T]) that holds every running request's new tokens,
with absolute position_ids. transformers hands each attention layer the new tokens' query/key/value (rotary
applied) and passes our per-step metadata through as a kwarg. Here we write the new K/V into the engine's
paged cache and attend each request over its own context only:
- decode requests (one new token) in one padded batched SDPA call over K/V gathered from their blocks;
- prefill chunks one SDPA call each, with a bottom-right-aligned causal mask (SDPA's is_causal is
  top-left aligned, wrong once cached tokens precede the chunk).
"""

from dataclasses import dataclass, field
from typing import Any

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
class AttentionMetadata:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V [num_blocks * block_size, Hkv, D]
    block_size: int
    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    decode_token_index: torch.Tensor | None  # [Nd] where each decode token sits in the packed batch
    decode_block_table: torch.Tensor | None  # [Nd, W] block ids of each context, padded with block 0
    decode_context_lens: torch.Tensor | None  # [Nd]
    prefills: list[PrefillSpan]
    _masks: dict[tuple[str, int, int | None], torch.Tensor] = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[Nd, 1, 1, W * block_size] True where a decode token may attend (its context, in the window)."""
        key = ("decode", 0, window)
        mask = self._masks.get(key)
        if mask is None:
            assert self.decode_block_table is not None
            assert self.decode_context_lens is not None
            lens = self.decode_context_lens[:, None]  # [Nd, 1]
            width = self.decode_block_table.shape[1] * self.block_size
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
    meta: AttentionMetadata = kwargs[METADATA_KWARG]
    k_cache, v_cache = meta.kv_caches[module.layer_idx]  # type: ignore[index]
    k_new = key[0].transpose(0, 1)  # [T, Hkv, D]
    v_new = value[0].transpose(0, 1)
    k_cache.index_copy_(0, meta.slot_mapping, k_new)
    v_cache.index_copy_(0, meta.slot_mapping, v_new)

    q = query[0]  # [H, T, D]
    out = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device)  # [T, H, D]

    if meta.decode_token_index is not None:
        assert meta.decode_block_table is not None
        q_d = q.index_select(1, meta.decode_token_index).transpose(0, 1).unsqueeze(2)  # [Nd, H, 1, D]
        k_d = _gather_blocks(k_cache, meta.decode_block_table, meta.block_size).transpose(
            1, 2
        )  # [Nd, Hkv, L, D]
        v_d = _gather_blocks(v_cache, meta.decode_block_table, meta.block_size).transpose(1, 2)
        o_d = F.scaled_dot_product_attention(
            q_d, k_d, v_d, attn_mask=meta.decode_mask(sliding_window), scale=scaling, enable_gqa=True
        )  # [Nd, H, 1, D]
        out.index_copy_(0, meta.decode_token_index, o_d.squeeze(2))

    for i, span in enumerate(meta.prefills):
        q_p = q[None, :, span.start : span.start + span.length]  # [1, H, n, D]
        if span.blocks is None:  # nothing cached before the chunk: attend to the new K/V directly
            k_p = key[:, :, span.start : span.start + span.length]
            v_p = value[:, :, span.start : span.start + span.length]
        else:
            blocks = span.blocks[None]
            k_p = _gather_blocks(k_cache, blocks, meta.block_size)[:, : span.context_len].transpose(1, 2)
            v_p = _gather_blocks(v_cache, blocks, meta.block_size)[:, : span.context_len].transpose(1, 2)
        if span.blocks is None and sliding_window is None:
            o_p = F.scaled_dot_product_attention(
                q_p, k_p, v_p, is_causal=True, scale=scaling, enable_gqa=True
            )
        else:
            mask = meta.prefill_mask(i, sliding_window)
            o_p = F.scaled_dot_product_attention(
                q_p, k_p, v_p, attn_mask=mask, scale=scaling, enable_gqa=True
            )
        out[span.start : span.start + span.length] = o_p[0].transpose(0, 1)

    return out.unsqueeze(0), None


def _gather_blocks(cache: torch.Tensor, table: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N, W * block_size, Hkv, D] from a block table [N, W]: whole blocks are copied, not single tokens."""
    blocks = cache.view(-1, block_size, *cache.shape[1:])  # [num_blocks, block_size, Hkv, D]
    return blocks.index_select(0, table.flatten()).view(table.shape[0], -1, *cache.shape[1:])


def register_paged_attention() -> str:
    """Register once per process (idempotent); returns the attn_implementation name to load models with."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    return ATTN_IMPLEMENTATION
