"""Rotary embedding of q and k in place, and the new k and v written into the paged cache: one launch.

HF Llama computes `x * cos + rotate_half(x) * sin` (rotate_half = cat(-x2, x1) over the halves of D) in the
model's dtype: each product and the sum are rounded to that dtype. The kernel rounds after each operation
in the same places, so its result is HF's bit for bit in fp32, fp16 and bf16 (the products of two 8- or
11-bit significands are exact in fp32, and torch rounds each fp32 result once, as we do); on CUDA it is
compiled without fp fusion so the fp32 product and sum are not fused into one FMA.

The table is HF's own cos and sin (LlamaRotaryEmbedding at positions 0..max_pos-1, in the model dtype, so
rope scaling and attention_scaling come with them), stacked as cos_sin [max_pos, 2, D]: see rotary_table.
"""

from __future__ import annotations

import torch

from deployments.engine.model.gpu_kernels._triton import jit, next_power_of_2, require_triton, tl


@jit
def _rotate(
    x_ptr, stride_t, stride_h, t, cos1, cos2, sin1, sin2,
    HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    """Rotates token t's heads in place; returns the rotated halves [HEADS_PAD, HALF_PAD] in x's dtype."""
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h < HEADS)[:, None] & (offs_d < HALF)[None, :]
    ptrs = x_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    # First half: x1 * cos + (-x2) * sin; second half: x2 * cos + x1 * sin; rounded as torch rounds.
    a = (x1.to(tl.float32) * cos1[None, :]).to(dtype)
    b = (-(x2.to(tl.float32)) * sin1[None, :]).to(dtype)  # -x2 is exact in any dtype
    y1 = (a.to(tl.float32) + b.to(tl.float32)).to(dtype)
    c = (x2.to(tl.float32) * cos2[None, :]).to(dtype)
    d = (x1.to(tl.float32) * sin2[None, :]).to(dtype)
    y2 = (c.to(tl.float32) + d.to(tl.float32)).to(dtype)
    tl.store(ptrs, y1, mask=mask)
    tl.store(ptrs + HALF, y2, mask=mask)
    return y1, y2


@jit
def _rotary_cache_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, positions_ptr, slots_ptr, k_cache_ptr, v_cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pos, stride_which,
    stride_kcs, stride_kch, stride_vcs, stride_vch,
    H: tl.constexpr, H_PAD: tl.constexpr, HKV: tl.constexpr, HKV_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    pos = tl.load(positions_ptr + t)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    cos_row = table_ptr + pos * stride_pos + offs_d
    sin_row = cos_row + stride_which
    cos1 = tl.load(cos_row, mask=d_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_row + HALF, mask=d_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row, mask=d_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + HALF, mask=d_mask, other=0.0).to(tl.float32)
    _rotate(q_ptr, stride_qt, stride_qh, t, cos1, cos2, sin1, sin2, H, H_PAD, HALF, HALF_PAD)
    k1, k2 = _rotate(k_ptr, stride_kt, stride_kh, t, cos1, cos2, sin1, sin2, HKV, HKV_PAD, HALF, HALF_PAD)

    slot = tl.load(slots_ptr + t).to(tl.int64)  # -1: padding, nothing is written
    offs_h = tl.arange(0, HKV_PAD)
    mask = (offs_h < HKV)[:, None] & d_mask[None, :] & (slot >= 0)
    k_dst = k_cache_ptr + slot * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    tl.store(k_dst, k1.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(k_dst + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v_src = v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    v_dst = v_cache_ptr + slot * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(v_dst, tl.load(v_src, mask=mask, other=0.0).to(v_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(
        v_dst + HALF, tl.load(v_src + HALF, mask=mask, other=0.0).to(v_cache_ptr.dtype.element_ty), mask=mask
    )


def rotary_table(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """cos_sin [max_pos, 2, D] from HF's cos and sin [max_pos, D] (or [1, max_pos, D]) for positions
    0..max_pos-1, e.g. `cos, sin = model.model.rotary_emb(x, torch.arange(max_pos)[None])`."""
    return torch.stack((cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])), dim=1).contiguous()


def _check_heads(name: str, x: torch.Tensor, tokens: int, dim: int) -> None:
    if x.dim() != 3 or x.shape[0] != tokens or x.shape[2] != dim or x.stride(2) != 1:
        raise ValueError(f"{name} must be [T={tokens}, heads, D={dim}] with a contiguous last dimension")


def rotary_and_cache(
    q: torch.Tensor,  # [T, H, D], any token and head strides (a view of a fused qkv output)
    k: torch.Tensor,  # [T, Hkv, D], same
    v: torch.Tensor,  # [T, Hkv, D], same
    cos_sin: torch.Tensor,  # [max_pos, 2, D] in q's dtype (rotary_table)
    positions: torch.Tensor,  # [T] int64, each < max_pos
    slot_mapping: torch.Tensor,  # [T] int64 cache slot of each token, -1: do not write
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
) -> None:
    """Rotates q and k in place (HF Llama rotary, bit for bit) and writes rotated k and v at slot_mapping."""
    require_triton()
    tokens, heads, dim = q.shape
    _check_heads("q", q, tokens, dim)
    _check_heads("k", k, tokens, dim)
    _check_heads("v", v, tokens, dim)
    kv_heads = k.shape[1]
    if v.shape[1] != kv_heads or k_cache.shape[1:] != (kv_heads, dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches must be [slots, {kv_heads}, {dim}] like k, got {tuple(k_cache.shape)}")
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("the caches need a contiguous last dimension")
    if dim % 2 or cos_sin.dim() != 3 or cos_sin.shape[1:] != (2, dim) or cos_sin.stride(2) != 1:
        raise ValueError(f"cos_sin must be [max_pos, 2, D={dim}] (rotary_table) and D even")
    if positions.shape != (tokens,) or slot_mapping.shape != (tokens,):
        raise ValueError(f"positions and slot_mapping must be [T={tokens}]")
    if not (positions.is_contiguous() and slot_mapping.is_contiguous()):
        raise ValueError("positions and slot_mapping must be contiguous")
    if tokens == 0:
        return
    half = dim // 2
    _rotary_cache_kernel[(tokens,)](
        q, k, v, cos_sin, positions, slot_mapping, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin.stride(0), cos_sin.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        H=heads, H_PAD=next_power_of_2(heads), HKV=kv_heads, HKV_PAD=next_power_of_2(kv_heads),
        HALF=half, HALF_PAD=next_power_of_2(half), num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
