"""The Triton kernels of deployments/engine/model/gpu_kernels against plain-torch and HF references.

Without a CUDA device the kernels run on CPU tensors through Triton's interpreter: TRITON_INTERPRET must be
set before Triton is first imported (it picks the interpreter when it decorates a kernel, its own tl.sum
included), which tests/triton_interpreter.py does from tests/conftest.py. With CUDA the same cases run
compiled (the `gpu` variants) and the interpreter variants skip. Without Triton every kernel test skips.

The interpreter's fp32 -> bf16 cast truncates (the GPU rounds to nearest), and it has no libdevice, so
where a kernel promises HF's bits, the interpreter is held to them in fp32/fp16 and to an ulp in bf16, and
CUDA to the bits in every dtype. Shapes are small: the interpreter runs each program in Python.
"""

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from app.modelprep.awq_export import quantize_linear_weight
from deployments.engine.model.gpu_kernels.activation import gelu_tanh_and_mul, silu_and_mul
from deployments.engine.model.gpu_kernels.awq_dequant import awq_dequantize
from deployments.engine.model.gpu_kernels.awq_gemm import awq_linear
from deployments.engine.model.gpu_kernels.lora_delta import (
    DECODE_TOKENS,
    DEFAULT_SMS,
    DeltaConfig,
    DeltaShape,
    chunks_of,
    delta_config,
    lora_delta,
    row_tiles,
)
from deployments.engine.model.gpu_kernels.lora_sgmv import lora_expand, lora_shrink
from deployments.engine.model.gpu_kernels.nf4_gemm import default_split_k, nf4_dequantize, nf4_linear
from deployments.engine.model.gpu_kernels.paged_attention import (
    _attend_kernel,
    num_partitions,
    paged_decode_attention,
)
from deployments.engine.model.gpu_kernels.rms_norm import rms_norm
from deployments.engine.model.gpu_kernels.rotary_cache import rotary_and_cache, rotary_table
from deployments.engine.model.lora_kernels import LoRABatch, loop_kernel
from deployments.engine.model.lora_layers import LoRAContext, MultiLoRALinear
from deployments.engine.model.projection import Projection

ROOT = Path(__file__).resolve().parents[2]
Result = TypeVar("Result")
CUDA = torch.cuda.is_available()


@pytest.fixture(
    params=[
        pytest.param(
            "cpu", marks=pytest.mark.skipif(CUDA, reason="with CUDA the kernels run compiled (gpu)")
        ),
        pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]),
    ]
)
def device(request: pytest.FixtureRequest) -> torch.device:
    triton = pytest.importorskip("triton")
    interpreted = [type(f).__name__ == "InterpretedFunction" for f in (triton.language.sum, _attend_kernel)]
    if request.param == "cpu" and not all(interpreted):
        pytest.fail("Triton was imported before TRITON_INTERPRET was set (tests/triton_interpreter.py)")
    return torch.device(request.param)


def randn(
    *shape: int, dtype: torch.dtype, device: torch.device, seed: int, scale: float = 1.0
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


def assert_within_ulps(
    got: torch.Tensor, want: torch.Tensor, ulps: float, unit: torch.dtype | None = None
) -> None:
    """Every element within `ulps` units in the last place of `unit` (default want's dtype); 0: same bits."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if ulps == 0:
        diff = (got != want).sum().item()
        assert diff == 0, f"{diff} of {want.numel()} elements differ; max {(got - want).abs().max().item()}"
        return
    info = torch.finfo(unit or want.dtype)
    tol = ulps * info.eps * want.float().abs().clamp_min(info.tiny)
    err = (got.float() - want.float()).abs()
    assert bool((err <= tol).all()), f"max error {err.max().item()} over {ulps} ulps"


def captured(step: Callable[[], Result]) -> tuple[torch.cuda.CUDAGraph, Result]:
    """step run once on a side stream (compiling every kernel outside the capture), then captured; the
    graph and what the captured call returned. Capture fails on a host sync."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result


# ------------------------------------------------------------------------------------------ attention


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """fp32 softmax attention per sequence over the slots its table names (GQA by repeating kv heads)."""
    batch, heads, _ = q.shape
    group = heads // k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b in range(batch):
        ctx = int(lens[b])
        pos = torch.arange(ctx)
        if window is not None:
            pos = pos[pos >= ctx - window]
        if len(pos) == 0:
            continue
        slots = tables[b].cpu()[pos // block_size].long() * block_size + pos % block_size
        k = k_cache.cpu()[slots].float().repeat_interleave(group, 1)  # [n, H, D]
        v = v_cache.cpu()[slots].float().repeat_interleave(group, 1)
        probs = (torch.einsum("hd,nhd->hn", q[b].cpu().float(), k) * scale).softmax(-1)
        out[b] = torch.einsum("hn,nhd->hd", probs, v)
    return out


@dataclass(frozen=True)
class AttentionCase:
    block_size: int
    kv_heads: int
    group: int
    dim: int
    dtype: torch.dtype
    lens: tuple[int, ...]
    width: int  # blocks per table row
    window: int | None


ATTENTION_CASES = {
    # ragged: an empty context, one token, exactly full blocks (16 = 4 blocks of 4), a partial block
    "bs4-G4-D64-fp32": AttentionCase(4, 2, 4, 64, torch.float32, (0, 1, 16, 23), 6, None),
    "bs1-G1-D16-fp16-window": AttentionCase(1, 2, 1, 16, torch.float16, (5, 0, 19), 20, 4),
    "bs16-G8-D128-fp16-window": AttentionCase(16, 1, 8, 128, torch.float16, (32, 40), 3, 20),
}


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=list(ATTENTION_CASES))
def test_paged_decode_attention_matches_the_reference(case: str, device: torch.device) -> None:
    c = ATTENTION_CASES[case]
    bs, kv, dim, dtype, width = c.block_size, c.kv_heads, c.dim, c.dtype, c.width
    heads, batch = kv * c.group, len(c.lens)
    num_blocks = 2 * width * batch
    # q is a view into a fused qkv output, out a view with a row stride: both as the engine hands them.
    qkv = randn(batch, (heads + 2 * kv) * dim, dtype=dtype, device=device, seed=1)
    q = qkv[:, : heads * dim].view(batch, heads, dim)
    k_cache = randn(num_blocks * bs, kv, dim, dtype=dtype, device=device, seed=2)
    v_cache = randn(num_blocks * bs, kv, dim, dtype=dtype, device=device, seed=3)
    gen = torch.Generator().manual_seed(4)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width).int().to(device)
    lens = torch.tensor(c.lens, dtype=torch.int32, device=device)
    scale = dim**-0.5
    want = reference_attention(q, k_cache, v_cache, tables, lens, bs, scale, c.window)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for parts in (1, 3):  # 3: split-K with a combine, some partitions empty for the short contexts
        out_buffer = torch.full((batch, heads, dim + 8), 9.0, dtype=dtype, device=device)
        out = out_buffer[:, :, :dim]
        got = paged_decode_attention(
            q, k_cache, v_cache, tables, lens, block_size=bs, scale=scale, sliding_window=c.window,
            out=out, partitions=parts, block_n=16,
        )  # fmt: skip
        assert got.data_ptr() == out.data_ptr()
        torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol, msg=f"partitions={parts}")
        assert bool((out_buffer[:, :, dim:] == 9.0).all())  # nothing written past the view


def test_paged_attention_splits_long_tables_by_shape_alone(device: torch.device) -> None:
    """Few programs and a wide table: the default splits (2 partitions of 256 positions here); the count
    depends on shapes only, and the result is the same as unsplit."""
    assert num_partitions(1, 2, 512, torch.device("cpu")) == 2
    assert num_partitions(256, 8, 8192, torch.device("cpu")) == 1  # enough programs already
    bs, dim, width = 16, 16, 32
    q = randn(1, 2, dim, dtype=torch.float32, device=device, seed=5)
    k_cache = randn(width * bs, 2, dim, dtype=torch.float32, device=device, seed=6)
    v_cache = randn(width * bs, 2, dim, dtype=torch.float32, device=device, seed=7)
    tables = torch.arange(width, dtype=torch.int32, device=device).flip(0)[None]
    lens = torch.tensor([300], dtype=torch.int32, device=device)
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size=bs, scale=0.25)
    want = reference_attention(q, k_cache, v_cache, tables, lens, bs, 0.25, None)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------- rotary and cache


ROTARY_CASES = [(torch.float32, 16), (torch.float16, 64), (torch.bfloat16, 128)]


@pytest.mark.parametrize(("dtype", "dim"), ROTARY_CASES, ids=[f"{d}-D{n}" for d, n in ROTARY_CASES])
def test_rotary_and_cache_is_hf_llama_bit_for_bit(dtype: torch.dtype, dim: int, device: torch.device) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    tokens, heads, kv, max_pos = 6, 4, 2, 64
    config = LlamaConfig(
        hidden_size=heads * dim,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max_pos,
    )
    rotary = LlamaRotaryEmbedding(config).to(device)
    probe = torch.zeros(1, dtype=dtype, device=device)
    cos, sin = rotary(probe, torch.arange(max_pos, device=device)[None])
    table = rotary_table(cos, sin)

    qkv = randn(tokens, (heads + 2 * kv) * dim, dtype=dtype, device=device, seed=8, scale=3.0)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv) * dim].view(tokens, kv, dim)
    v = qkv[:, (heads + kv) * dim :].view(tokens, kv, dim)
    positions = torch.tensor([0, 3, 17, 63, 5, 9], device=device)
    slots = torch.tensor([4, -1, 0, 7, 2, -1], device=device)  # -1: padding, not written
    k_cache = torch.full((8, kv, dim), 5.0, dtype=dtype, device=device)
    v_cache = torch.full((8, kv, dim), 5.0, dtype=dtype, device=device)
    # HF at the same positions, in [1, heads, T, D] as the model calls it.
    q_hf, k_hf = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[:, positions], sin[:, positions]
    )
    q_want, k_want, v_want = q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1), v.clone()

    rotary_and_cache(q, k, v, table, positions, slots, k_cache, v_cache)

    if device.type == "cpu" and dtype == torch.bfloat16:
        # The interpreter truncates where the GPU rounds, at each of three roundings, and the sum can
        # cancel: bounded by ulps of the operands, not of the result.
        atol = 3 * 2**-7 * max(q_want.abs().max().item(), k_want.abs().max().item())
        torch.testing.assert_close(q, q_want, atol=atol, rtol=0)
        torch.testing.assert_close(k, k_want, atol=atol, rtol=0)
    else:
        assert_within_ulps(q, q_want, 0)
        assert_within_ulps(k, k_want, 0)
    assert torch.equal(v, v_want)
    written = [(t, int(s)) for t, s in enumerate(slots.tolist()) if s >= 0]
    for t, s in written:
        assert torch.equal(k_cache[s], k[t]) and torch.equal(v_cache[s], v[t])
    untouched = sorted(set(range(8)) - {s for _, s in written})
    assert bool((k_cache[untouched] == 5.0).all()) and bool((v_cache[untouched] == 5.0).all())


# ------------------------------------------------------------------------------------------- rms norm


@pytest.mark.parametrize(
    ("dtype", "weight_dtype"),
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
     (torch.bfloat16, torch.float32)],
)  # fmt: skip
def test_rms_norm_matches_hf_llama(
    dtype: torch.dtype, weight_dtype: torch.dtype, device: torch.device
) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    rows, hidden, eps = 5, 96, 1e-5  # hidden not a power of 2: a masked tail
    norm = LlamaRMSNorm(hidden, eps=eps).to(device=device, dtype=weight_dtype)
    norm.weight.data = randn(hidden, dtype=weight_dtype, device=device, seed=9)
    x_buffer = randn(rows, hidden + 4, dtype=dtype, device=device, seed=10, scale=2.0)
    x = x_buffer[:, :hidden]  # a row stride
    residual = randn(rows, hidden, dtype=dtype, device=device, seed=11)
    # torch sums the squares in another order and its rsqrt is not correctly rounded: a few fp32 ulps in
    # the scale, which can flip a rounding to 16 bits (one ulp of x's dtype; two where the interpreter
    # truncates bf16).
    ulps = 8 if dtype == torch.float32 else 2 if device.type == "cpu" and dtype == torch.bfloat16 else 1
    with torch.no_grad():
        plain = rms_norm(x, norm.weight, eps)
        assert isinstance(plain, torch.Tensor)
        assert_within_ulps(plain, norm(x), ulps, unit=dtype)

        h = residual + x
        out, new_residual = rms_norm(x, norm.weight, eps, residual)
        assert_within_ulps(new_residual, h, 0 if dtype != torch.bfloat16 or device.type == "cuda" else 1)
        assert_within_ulps(out, norm(new_residual), ulps, unit=dtype)
        if dtype == torch.float16:  # a missing rounding before the weight would differ in about a quarter
            assert (out != norm(new_residual)).sum().item() <= out.numel() // 20

        # In place: the residual buffer takes the sum, x's buffer the output (when their dtypes agree).
        if weight_dtype == dtype:
            res_buf = residual.clone()
            got = rms_norm(x, norm.weight, eps, res_buf, out=x, residual_out=res_buf)
            assert got[0].data_ptr() == x.data_ptr() and got[1].data_ptr() == res_buf.data_ptr()
            assert torch.equal(x, out) and torch.equal(res_buf, new_residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unit_offset_rms_norm_matches_hf_gemma3(dtype: torch.dtype, device: torch.device) -> None:
    """Gemma's (1 + w) norm, the model's fp32 weight folded once as the forward does (decoder_families.Norm),
    alone and after the residual add; rows of [T * heads, head_dim] too, as the per-head q/k norms run."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    rows, hidden, eps = 6, 80, 1e-6
    norm = Gemma3RMSNorm(hidden, eps=eps).to(device=device, dtype=dtype)
    norm.weight.data = randn(hidden, dtype=dtype, device=device, seed=13, scale=0.5)
    folded = (1.0 + norm.weight.detach().float()).contiguous()
    x = randn(rows, hidden + 4, dtype=dtype, device=device, seed=14, scale=2.0)[:, :hidden]
    residual = randn(rows, hidden, dtype=dtype, device=device, seed=15)
    # One rounding, at the end: torch's rsqrt and sum order against ours can flip it by one ulp of x's dtype
    # (two where the interpreter truncates bf16).
    ulps = 8 if dtype == torch.float32 else 2 if device.type == "cpu" and dtype == torch.bfloat16 else 1
    with torch.no_grad():
        plain = rms_norm(x, folded, eps, unit_offset=True)
        assert isinstance(plain, torch.Tensor) and plain.dtype == dtype
        assert_within_ulps(plain, norm(x), ulps, unit=dtype)
        out, summed = rms_norm(x, folded, eps, residual, unit_offset=True)
        assert_within_ulps(summed, residual + x, 0 if dtype != torch.bfloat16 or device.type == "cuda" else 1)
        assert_within_ulps(out, norm(summed), ulps, unit=dtype)
        if dtype == torch.float16:  # rounding the normed row before the weight (Llama's way) differs often
            assert (out != norm(summed)).sum().item() <= out.numel() // 20
        with pytest.raises(ValueError, match="fp32"):
            rms_norm(x, folded.to(torch.float16), eps, unit_offset=True)


# ----------------------------------------------------------------------------------------- activation


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_silu_and_mul_matches_hf_mlp(dtype: torch.dtype, device: torch.device) -> None:
    rows, inter = 3, 1100  # two column blocks, the second partial
    gate_up_buffer = randn(rows, 2 * inter + 8, dtype=dtype, device=device, seed=12, scale=3.0)
    gate_up = gate_up_buffer[:, : 2 * inter]
    want = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
    out = torch.empty(rows, inter + 3, dtype=dtype, device=device)[:, :inter]
    got = silu_and_mul(gate_up, out=out)
    assert got.data_ptr() == out.data_ptr()
    if device.type == "cuda":
        assert_within_ulps(got, want, 0)  # libdevice expf and IEEE division: torch's own arithmetic
    else:  # numpy's exp for libdevice's: an fp32 ulp, which a rounding to 16 bits rarely shows
        assert_within_ulps(got, want, {torch.float32: 4, torch.float16: 1, torch.bfloat16: 2}[dtype])
        if dtype == torch.float16:  # rounding silu once less would differ in about a quarter of them
            assert (got != want).sum().item() <= want.numel() // 100


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gelu_tanh_and_mul_matches_hf_gemma_mlp(dtype: torch.dtype, device: torch.device) -> None:
    rows, inter = 3, 1100
    gate_up = randn(rows, 2 * inter + 8, dtype=dtype, device=device, seed=16, scale=3.0)[:, : 2 * inter]
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    want = F.gelu(gate, approximate="tanh") * up  # Gemma3MLP: act_fn(gate_proj(x)) * up_proj(x)
    out = torch.empty(rows, inter + 3, dtype=dtype, device=device)[:, :inter]
    got = gelu_tanh_and_mul(gate_up, out=out)
    assert got.data_ptr() == out.data_ptr()
    # `1 + tanh(...)` cancels where the gate is negative: there torch's own result carries an error of about
    # an fp32 ulp of 1 times |gate * up| / 2, so that is the scale the tolerance is taken at. CUDA: libdevice
    # tanhf as torch's kernel, which nvcc may contract into FMAs; the interpreter: tanh through numpy's exp,
    # and bf16 casts that truncate.
    ulps = 1 if device.type == "cuda" else {torch.float32: 4, torch.float16: 1, torch.bfloat16: 2}[dtype]
    scale = want.float().abs() + (gate.float() * up.float()).abs() / 2
    err = (got.float() - want.float()).abs()
    assert bool((err <= ulps * torch.finfo(dtype).eps * scale).all()), f"max error {err.max().item()}"
    if dtype == torch.float16:  # rounding the activation once less would differ in about a quarter
        assert (got != want).sum().item() <= want.numel() // 20
    erf = F.gelu(gate) * up  # the exact GELU is another function: this is the tanh one
    assert (got != erf).sum().item() > want.numel() // 4


# ---------------------------------------------------------------------------------------------- LoRA


def loop_reference(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ends: list[int],
    y: torch.Tensor,
    splits: tuple[int, ...],
) -> torch.Tensor:
    """Today's engine path member by member (lora_kernels.loop_kernel), x cast to the adapters' dtype."""
    y = y.clone()
    rank = b.shape[1]
    starts = [0, *ends[:-1]]
    segments = [
        (s, start, end) for s, (start, end) in enumerate(zip(starts, ends, strict=True)) if end > start
    ]
    batch = LoRABatch(
        num_lora_tokens=ends[-1],
        offsets=torch.tensor(ends, dtype=torch.int32),
        segments=segments,
        segment_table=torch.tensor(segments, dtype=torch.int64).view(-1, 3),
    )
    col = 0
    for p, width in enumerate(splits):
        member_y = y[:, col : col + width]
        member_a = a[:, :, p * rank : (p + 1) * rank]
        loop_kernel(member_y, x.to(a.dtype), member_a, b[:, :, col : col + width], batch)
        col += width
    return y


@dataclass(frozen=True)
class LoRACase:
    dtype: torch.dtype  # the adapters' and y's
    x_dtype: torch.dtype
    rank: int
    splits: tuple[int, ...]
    ends: list[int]
    tokens: int
    k: int
    index_dtype: torch.dtype = torch.int32


LORA_CASES = {
    # q/k/v: an empty slot, a one-token slot, a segment over three 16-row tiles, two rows without adapters
    "qkv-rank16-fp32": LoRACase(torch.float32, torch.float32, 16, (32, 16, 16), [3, 3, 4, 38], 40, 48),
    # gate/up, rank 4 (padded to 16 for tl.dot), the first slot empty, fp16, the engine's int64 ends
    "gate-up-rank4-fp16": LoRACase(torch.float16, torch.float16, 4, (48, 48), [0, 5, 5], 6, 32, torch.int64),
    # widths no column block divides, rank 64, fp32 activations and fp16 adapters
    "uneven-rank64-mixed": LoRACase(torch.float16, torch.float32, 64, (40, 24, 8), [2, 7], 9, 40),
    # one token (T = 1), one member (down), its slot the middle one
    "one-token-down": LoRACase(torch.float32, torch.float32, 16, (40,), [0, 1, 1], 1, 24),
    # every slot one row past a tile: the tiles reach lora_delta's grid bound T // 16 + S exactly
    "tight-tile-bound": LoRACase(torch.float32, torch.float32, 8, (16, 32), [17, 18, 19, 20], 20, 16),
    # prefill blocks (T > DECODE_TOKENS: 64-row tiles), segments over several tiles, ten rows without
    "prefill-300-tokens": LoRACase(
        torch.float32, torch.float32, 16, (64, 32), [0, 70, 71, 200, 200, 290], 300, 32, torch.int64
    ),
    # five members: lora_delta launches twice (four members a launch), lora_expand once per member
    "five-members-rank4": LoRACase(torch.float16, torch.float16, 4, (16, 16, 32, 16, 16), [4, 9], 11, 16),
}


@dataclass(frozen=True)
class LoRAOperands:
    x: torch.Tensor  # a view with a row stride
    a: torch.Tensor  # R columns of a wider buffer
    b: torch.Tensor
    y_buffer: torch.Tensor
    y: torch.Tensor  # a view of y_buffer's first columns
    seg_ends: torch.Tensor
    want: torch.Tensor  # y after the loop kernel


def lora_operands(c: LoRACase, device: torch.device) -> LoRAOperands:
    slots, members, width = len(c.ends), len(c.splits), sum(c.splits)
    x = randn(c.tokens, c.k + 3, dtype=c.x_dtype, device=device, seed=13)[:, : c.k]
    a_buffer = randn(slots, c.k, members * c.rank + 8, dtype=c.dtype, device=device, seed=14, scale=0.2)
    a = a_buffer[:, :, : members * c.rank]
    b = randn(slots, c.rank, width, dtype=c.dtype, device=device, seed=15, scale=0.2)
    y_buffer = randn(c.tokens, width + 5, dtype=c.dtype, device=device, seed=16)
    y = y_buffer[:, :width]
    want = loop_reference(x.cpu(), a.cpu(), b.cpu(), c.ends, y.cpu(), c.splits)
    seg_ends = torch.tensor(c.ends, dtype=c.index_dtype, device=device)
    return LoRAOperands(x, a, b, y_buffer, y, seg_ends, want)


def assert_lora_delta_added(c: LoRACase, o: LoRAOperands, before: torch.Tensor) -> None:
    """y holds the loop kernel's values; rows without an adapter and columns past the view are untouched."""
    tol = 1e-5 if c.dtype == torch.float32 else 4e-3
    torch.testing.assert_close(o.y.cpu(), o.want, atol=tol, rtol=tol)
    assert torch.equal(o.y_buffer[c.ends[-1] :], before[c.ends[-1] :])
    assert torch.equal(o.y_buffer[:, o.y.shape[1] :], before[:, o.y.shape[1] :])


@pytest.mark.parametrize("case", LORA_CASES, ids=list(LORA_CASES))
def test_lora_shrink_and_expand_match_the_loop_kernel(case: str, device: torch.device) -> None:
    c = LORA_CASES[case]
    o = lora_operands(c, device)
    h = torch.full((c.tokens, len(c.splits) * c.rank), 7.0, device=device)
    lora_shrink(o.x, o.a, o.seg_ends, h)
    want_h = torch.cat([
        o.x[start:end].float().cpu() @ o.a[s].float().cpu()
        for s, (start, end) in enumerate(zip([0, *c.ends[:-1]], c.ends, strict=True))
    ])  # fmt: skip
    torch.testing.assert_close(h[: c.ends[-1]].cpu(), want_h, atol=2e-3, rtol=2e-3)
    assert bool((h[c.ends[-1] :] == 7.0).all())  # rows without an adapter are left untouched

    before = o.y_buffer.clone()
    lora_expand(h, o.b, o.seg_ends, o.y, splits=c.splits)
    assert_lora_delta_added(c, o, before)


# default blocks, and small ones: chunks of 16 columns (several per member), or 48 (not dividing members)
DELTA_CONFIGS = {
    "default": None,
    "cols16": DeltaConfig(block_m=16, block_k=16, block_n=16, columns=16),
    "cols48": DeltaConfig(block_m=16, block_k=32, block_n=16, columns=48),
}


@pytest.mark.parametrize("config", DELTA_CONFIGS, ids=list(DELTA_CONFIGS))
@pytest.mark.parametrize("case", LORA_CASES, ids=list(LORA_CASES))
def test_lora_delta_matches_the_loop_kernel(case: str, config: str, device: torch.device) -> None:
    c = LORA_CASES[case]
    o = lora_operands(c, device)
    before = o.y_buffer.clone()
    lora_delta(o.x, o.a, o.b, o.seg_ends, o.y, splits=c.splits, config=DELTA_CONFIGS[config])
    assert_lora_delta_added(c, o, before)


def test_the_row_tile_bound_holds_for_every_split() -> None:
    """The grid's row dimension: no split of T tokens among S slots has more non-empty (slot, tile) pairs,
    and some splits reach it (so a smaller grid would drop rows)."""
    gen = torch.Generator().manual_seed(44)
    for _ in range(2000):
        tokens = int(torch.randint(1, 400, (1,), generator=gen))
        slots = int(torch.randint(1, 40, (1,), generator=gen))
        block_m = (16, 64)[int(torch.randint(0, 2, (1,), generator=gen))]
        cuts = torch.randint(0, tokens + 1, (slots,), generator=gen).sort().values.tolist()
        lengths = [end - start for start, end in zip([0, *cuts[:-1]], cuts, strict=True)]
        assert sum(-(-n // block_m) for n in lengths) <= row_tiles(tokens, slots, block_m)
    assert sum(-(-n // 16) for n in (17, 1, 1, 1)) == row_tiles(20, 4, 16)


def test_delta_config_spreads_decode_and_reads_prefill_tiles_once_per_member() -> None:
    """bench-1b's q/k/v (hidden 2048, q 2048, kv 256 + 256, rank 16, bf16, 16 slots): at decode (T = 32)
    the grid is about one program per SM (not 16, one per slot); at prefill (T = 4096) each program covers
    a whole member, so each 64-row x tile is read once per member."""
    widths = (2048, 256, 256)

    def config(tokens: int) -> tuple[DeltaConfig, int]:
        chosen = delta_config(DeltaShape(tokens, 16, widths, 2048, 16, 2, 2, 2, DEFAULT_SMS))
        programs = sum(chunks_of(widths, chosen.columns)) * row_tiles(tokens, 16, chosen.block_m)
        return chosen, programs

    decode, programs = config(32)
    assert decode.block_m == 16 and DEFAULT_SMS // 2 <= programs <= 2 * DEFAULT_SMS, (decode, programs)
    prefill, _ = config(4096)
    assert DECODE_TOKENS < 4096 and prefill.block_m == 64 and prefill.columns >= max(widths), prefill


@dataclass(frozen=True)
class RunsCase:
    """Adapters in runs of pages: `runs` at each run's first page (other entries stale, never read)."""

    dtype: torch.dtype
    page_rank: int
    splits: tuple[int, ...]
    ends: list[int]  # cumulative token ends per page
    runs: list[int]
    max_pages: int
    tokens: int
    k: int = 24


RUNS_CASES = {
    # pages of 8: a 3-page run, a 1-page one, an idle page holding a stale 9, a 2-page run; one base row
    "decode-fp32": RunsCase(torch.float32, 8, (32, 16), [3, 3, 3, 5, 5, 9, 9], [3, 9, 9, 1, 9, 2, 9], 4, 10),
    # prefill tiles, int64 like the engine, five members (two launches), bf16-sized pages of 4 in fp16
    "prefill-five-members-fp16": RunsCase(
        torch.float16, 4, (16, 16, 32, 16, 16), [0, 150, 150, 150, 290], [1, 3, 0, 0, 1], 3, 300
    ),
}


def runs_reference(
    c: RunsCase, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """Each adapter alone: its run's A columns and B rows side by side, h in fp32 rounded to the adapters'
    dtype, one delta over the run's whole rank."""
    y = y.clone()
    r, col = c.page_rank, 0
    for p, width in enumerate(c.splits):
        for page, (start, end) in enumerate(zip([0, *c.ends[:-1]], c.ends, strict=True)):
            if end == start:
                continue
            run = range(page, page + c.runs[page])
            a_run = torch.cat([a[q, :, p * r : (p + 1) * r] for q in run], dim=1).float()
            b_run = torch.cat([b[q, :, col : col + width] for q in run], dim=0)
            h = (x[start:end].to(a.dtype).float() @ a_run).to(b.dtype)
            delta = h.float() @ b_run.float()
            y[start:end, col : col + width] = (
                y[start:end, col : col + width].float() + delta.to(y.dtype).float()
            ).to(y.dtype)
        col += width
    return y


@pytest.mark.parametrize("config", ["default", "cols16"])
@pytest.mark.parametrize("case", RUNS_CASES, ids=list(RUNS_CASES))
def test_lora_delta_reads_adapters_in_runs_of_pages(case: str, config: str, device: torch.device) -> None:
    c = RUNS_CASES[case]
    pages, members, width = len(c.ends), len(c.splits), sum(c.splits)
    x = randn(c.tokens, c.k, dtype=c.dtype, device=device, seed=61)
    a = randn(pages, c.k, members * c.page_rank, dtype=c.dtype, device=device, seed=62, scale=0.3)
    b = randn(pages, c.page_rank, width, dtype=c.dtype, device=device, seed=63, scale=0.3)
    y = randn(c.tokens, width, dtype=c.dtype, device=device, seed=64)
    want = runs_reference(c, x.cpu(), a.cpu(), b.cpu(), y.cpu())
    seg_ends = torch.tensor(c.ends, dtype=torch.int64, device=device)
    runs = torch.tensor(c.runs, dtype=torch.int64, device=device)
    lora_delta(
        x, a, b, seg_ends, y, splits=c.splits, runs=runs, max_pages=c.max_pages, config=DELTA_CONFIGS[config]
    )
    tol = 1e-5 if c.dtype == torch.float32 else 4e-3
    torch.testing.assert_close(y.cpu(), want, atol=tol, rtol=tol)
    # the same weights read as one page an adapter give another answer: the run's later pages were read
    one_page = y.clone().copy_(randn(c.tokens, width, dtype=c.dtype, device=device, seed=64))
    lora_delta(x, a, b, seg_ends, one_page, splits=c.splits, config=DELTA_CONFIGS[config])
    assert not torch.allclose(one_page.cpu(), want, atol=tol, rtol=tol)


def test_lora_delta_refuses_mismatched_shapes(device: torch.device) -> None:
    x = torch.zeros(4, 8, device=device)
    a = torch.zeros(2, 8, 32, device=device)  # two members of rank 16
    b = torch.zeros(2, 16, 24, device=device)
    ends = torch.tensor([1, 3], dtype=torch.int32, device=device)
    y = torch.zeros(4, 24, device=device)
    with pytest.raises(ValueError, match="splits"):
        lora_delta(x, a, b, ends, y, splits=(8, 8))
    with pytest.raises(ValueError, match="a must be"):
        lora_delta(x, a, b, ends, y, splits=(8, 8, 8))
    with pytest.raises(ValueError, match="seg_ends"):
        lora_delta(x, a, b, ends.float(), y, splits=(12, 12))
    with pytest.raises(ValueError, match="y must be"):
        lora_delta(x, a, b, ends, y.t(), splits=(12, 12))
    with pytest.raises(ValueError, match="runs"):
        lora_delta(x, a, b, ends, y, splits=(12, 12), runs=ends[:1], max_pages=2)
    with pytest.raises(ValueError, match="max_pages"):
        lora_delta(x, a, b, ends, y, splits=(12, 12), max_pages=2)


class NotPlainLinear(nn.Linear):
    """A base the projection does not fuse (its type is not nn.Linear), as a quantized linear."""


@pytest.mark.parametrize("quantized", [False, True], ids=["fused-base", "member-bases"])
def test_projection_lora_on_triton_equals_the_module_path(quantized: bool, device: torch.device) -> None:
    """q/k/v through Projection with Triton LoRA (one fused launch, or one per member over separate base
    outputs) against each MultiLoRALinear's own forward with the step's LoRAContext (the CPU path)."""
    hidden, widths, slots, rank, tokens = 32, (32, 16, 16), 3, 8, 7
    context = LoRAContext()
    linear = NotPlainLinear if quantized else nn.Linear

    def build() -> list[nn.Module]:
        torch.manual_seed(45)
        members: list[nn.Module] = []
        for width in widths:
            member = MultiLoRALinear(
                linear(hidden, width, bias=False), in_features=hidden, out_features=width, pages=slots,
                page_rank=rank, dtype=torch.float32, device=device, context=context,
            )  # fmt: skip
            member.lora_a.copy_(torch.randn(slots, hidden, rank) * 0.3)
            member.lora_b.copy_(torch.randn(slots, rank, width) * 0.3)
            members.append(member.to(device))
        return members

    ends = [2, 2, 6]  # an empty slot; the last row has no adapter
    segments = [(0, 0, 2), (2, 2, 6)]
    batch = LoRABatch(
        num_lora_tokens=ends[-1],
        offsets=torch.tensor(ends, dtype=torch.int64, device=device),
        segments=segments,
        segment_table=torch.tensor(segments, dtype=torch.int64),
    )
    x = randn(tokens, hidden, dtype=torch.float32, device=device, seed=46)
    context.batch = batch
    with torch.no_grad():
        want = [m(x) for m in build()]
        projection = Projection(build(), fuse_base=True, group_lora=True)
        assert projection.fused != quantized and projection.lora_a is not None
        got = projection(x, batch)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [32, 1024], ids=["decode", "prefill"])
def test_lora_delta_replays_in_a_cuda_graph_with_new_segments(tokens: int) -> None:
    """Captured once per shape, replayed as the step's segment ends change in place (int64, as the engine
    packs them): the same bits as an eager call, and the loop kernel's values, for every split."""
    pytest.importorskip("triton")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    slots, rank, k, splits = 16, 16, 256, (256, 64, 64)
    width = sum(splits)
    x = randn(tokens, k, dtype=dtype, device=dev, seed=47)
    a = randn(slots, k, len(splits) * rank, dtype=dtype, device=dev, seed=48, scale=0.1)
    b = randn(slots, rank, width, dtype=dtype, device=dev, seed=49, scale=0.1)
    y0 = randn(tokens, width, dtype=dtype, device=dev, seed=50)
    y = y0.clone()
    seg_ends = torch.zeros(slots, dtype=torch.int64, device=dev)

    def step() -> None:
        y.copy_(y0)
        lora_delta(x, a, b, seg_ends, y, splits=splits)

    graph, _ = captured(step)
    gen = torch.Generator().manual_seed(51)
    splits_of_tokens = [
        [0] * slots,  # no adapters at all
        [tokens] * slots,  # every token in the first slot
        [min(tokens, 17 * (s + 1)) for s in range(slots)],  # one row past a tile each
        torch.randint(0, tokens + 1, (slots,), generator=gen).sort().values.tolist(),
        torch.randint(0, tokens + 1, (slots,), generator=gen).sort().values.tolist(),
    ]
    for ends in splits_of_tokens:
        seg_ends.copy_(torch.tensor(ends))
        graph.replay()
        replayed = y.clone()
        step()
        assert torch.equal(replayed, y), ends
        want = loop_reference(x.cpu(), a.cpu(), b.cpu(), ends, y0.cpu(), splits)
        torch.testing.assert_close(replayed.cpu(), want, atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------------------------- AWQ


@pytest.mark.parametrize(("k", "n", "group"), [(64, 96, 32), (80, 64, 16)])
def test_awq_dequantize_is_gptqmodels_weight(k: int, n: int, group: int, device: torch.device) -> None:
    """Bit for bit gptqmodel's dequantize_gemm (the weight its AWQ linears multiply by off the CPU kernel).
    gptqmodel's helper is restated here in torch where gptqmodel is not installed (the GPU image)."""
    packed = quantize_linear_weight(
        randn(n, k, dtype=torch.float32, device=torch.device("cpu"), seed=17), group
    )
    for dtype in (torch.float16, torch.float32, torch.bfloat16):
        scales = packed.scales.to(dtype)
        got = awq_dequantize(packed.qweight.to(device), packed.qzeros.to(device), scales.to(device), group)
        want = _gptqmodel_dequantize(packed.qweight, packed.qzeros, scales, group)
        ulps = 0 if device.type == "cuda" or dtype != torch.bfloat16 else 1
        assert_within_ulps(got.cpu(), want, ulps)


def _gptqmodel_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int):
    if importlib.util.find_spec("gptqmodel") is not None:
        from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

        return dequantize_gemm(qweight, qzeros, scales, 4, group)
    shifts = torch.tensor([0, 16, 4, 20, 8, 24, 12, 28])  # column c of 8 sits in nibble (0 2 4 6 1 3 5 7)^-1
    codes = ((qweight[..., None] >> shifts) & 0xF).flatten(1)
    zeros = ((qzeros[..., None] >> shifts) & 0xF).flatten(1).repeat_interleave(group, 0)[: qweight.shape[0]]
    return (codes - zeros) * scales.repeat_interleave(group, 0)[: qweight.shape[0]]


def test_awq_dequantize_reproduces_the_cpu_awq_layer(device: torch.device) -> None:
    """x @ awq_dequantize(...) against gptqmodel's TorchAtenAwqLinear (what our CPU AWQ path loads) run on
    the same packed weights: exactly its dequantizing path, and its fused int4 CPU kernel (bf16 inside)
    to bf16 accuracy. A wrong nibble order or zero would be off by the whole weight."""
    pytest.importorskip("gptqmodel")
    from gptqmodel.nn_modules.qlinear.torch_aten_kernel_awq import TorchAtenAwqLinear

    k, n, group = 64, 96, 32
    packed = quantize_linear_weight(
        randn(n, k, dtype=torch.float32, device=torch.device("cpu"), seed=18), group
    )
    weight = awq_dequantize(
        packed.qweight.to(device), packed.qzeros.to(device), packed.scales.to(device), group
    )

    def layer(mode: str | None) -> TorchAtenAwqLinear:
        module = TorchAtenAwqLinear(
            bits=4, group_size=group, sym=False, desc_act=False, in_features=k, out_features=n, bias=False
        )
        module.qweight.copy_(packed.qweight)
        module.qzeros.copy_(packed.qzeros)
        module.scales.copy_(packed.scales)
        module.post_init()
        module.linear_mode = mode  # "train": dequantize and matmul; None: the fused kernel on first call
        return module.eval()

    for dtype in (torch.float32, torch.float16):
        x = randn(5, k, dtype=dtype, device=torch.device("cpu"), seed=19)
        ours = x @ weight.cpu().to(dtype)
        with torch.no_grad():
            assert torch.equal(layer("train")(x), ours)
            fused = layer(None)(x)
        assert fused.dtype == dtype
        rel = ((fused.float() - ours.float()).abs().max() / ours.float().abs().max()).item()
        assert rel < 1e-2, rel


@pytest.mark.parametrize(
    ("rows", "k", "n", "group", "dtype"),
    [(5, 64, 96, 32, torch.float16), (40, 128, 72, 64, torch.float32), (17, 256, 64, 128, torch.float16)],
)
def test_awq_linear_is_x_times_the_dequantized_weight(
    rows: int, k: int, n: int, group: int, dtype: torch.dtype, device: torch.device
) -> None:
    """The fused int4 GEMM: several K tiles per group (group 128), partial row and column blocks, x as a
    strided view; the same weights as awq_dequantize, summed in another order."""
    packed = quantize_linear_weight(
        randn(n, k, dtype=torch.float32, device=torch.device("cpu"), seed=32), group
    )
    qweight, qzeros, scales = (
        packed.qweight.to(device),
        packed.qzeros.to(device),
        packed.scales.to(device, dtype),
    )
    x = randn(rows, k + 8, dtype=dtype, device=device, seed=33)[:, :k]
    want = (x.float() @ awq_dequantize(qweight, qzeros, scales, group).float()).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for split_k in (1, 2):  # 2: whole groups per split, partial sums added in a fixed order
        got = awq_linear(x, qweight, qzeros, scales, group, split_k=split_k)
        torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=tol)


# ----------------------------------------------------------------------------------------------- NF4


@dataclass(frozen=True)
class NF4Weight:
    """A weight quantized by bitsandbytes itself (its quantize_4bit), and its dequantization."""

    packed: torch.Tensor  # cdiv(N * K, 2) uint8
    absmax: torch.Tensor  # fp32 (the nested absmax already dequantized, as dequantize_4bit does)
    code: torch.Tensor
    dense: torch.Tensor  # [N, K] fp32: bitsandbytes' dequantization
    original: torch.Tensor  # [N, K] the weight before quantization


def bnb_nf4(n: int, k: int, *, nested: bool, seed: int, blocksize: int = 64) -> NF4Weight:
    """Quantized on the CPU by bitsandbytes. Its CPU backend's native dequantization indexes absmax blocks
    per row (row * (K // blocksize) + col // blocksize), which disagrees with its own quantizer (and its
    CUDA kernels) where K is not a multiple of the block, so the dense weight is bitsandbytes' layout
    restated (backends/default/ops.py, which its CUDA kernel matches): high nibble first, blocks along the
    flattened weight. Where K is a multiple of the block it is checked equal to `dequantize_4bit`'s."""
    bnbf = pytest.importorskip("bitsandbytes.functional")
    original = randn(n, k, dtype=torch.float32, device=torch.device("cpu"), seed=seed)
    packed, state = bnbf.quantize_4bit(
        original, blocksize=blocksize, compress_statistics=nested, quant_type="nf4"
    )
    absmax = state.absmax
    if nested:
        absmax = (bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset).float()
    flat = packed.reshape(-1)
    codes = torch.stack([flat >> 4, flat & 0xF], dim=1).reshape(-1)[: n * k].long()
    blocks = torch.arange(n * k) // blocksize
    dense = (state.code[codes] * absmax[blocks]).view(n, k)
    if k % blocksize == 0:
        assert torch.equal(bnbf.dequantize_4bit(packed, state, quant_type="nf4"), dense)
    # NF4 rounds each weight to the nearest of 16 levels of its block's absmax: off by at most half the
    # widest gap (0.304 between -1 and -0.696) of the true absmax, plus the 8-bit absmax's own error when
    # nested. A wrong nibble order or block index would be off by far more.
    padded = F.pad(original.reshape(-1).abs(), (0, absmax.numel() * blocksize - n * k))
    true_absmax = padded.view(-1, blocksize).amax(dim=1)
    bound = 0.153 * true_absmax[blocks] + (absmax - true_absmax).abs()[blocks] + 1e-6
    assert bool(((dense - original).abs().reshape(-1) <= bound).all())
    return NF4Weight(flat.contiguous(), absmax.contiguous(), state.code, dense, original)


def nf4_args(w: NF4Weight, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return w.packed.to(device), w.absmax.to(device), w.code.to(device)


NF4_SHAPES = {
    # (N, K, blocksize): K a multiple of the block (one absmax per row and sub-tile), and not (blocks run
    # across rows), K odd (rows start mid-byte), N*K odd (a padding nibble), a block of 128
    "96x128": (96, 128, 64),
    "72x80": (72, 80, 64),
    "40x33": (40, 33, 64),
    "7x45": (7, 45, 32),
    "48x256-bs128": (48, 256, 128),
}


@pytest.mark.parametrize("shape", NF4_SHAPES, ids=list(NF4_SHAPES))
@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "double-quant"])
def test_nf4_dequantize_is_bitsandbytes_weight(shape: str, nested: bool, device: torch.device) -> None:
    n, k, bs = NF4_SHAPES[shape]
    w = bnb_nf4(n, k, nested=nested, seed=40, blocksize=bs)
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if device.type == "cuda" else [])
    for dtype in dtypes:  # the fp32 product rounded once to dtype, as dequantize_4bit rounds it
        got = nf4_dequantize(*nf4_args(w, device), out_features=n, in_features=k, blocksize=bs, dtype=dtype)
        assert_within_ulps(got.cpu(), w.dense.to(dtype), 0)


@dataclass(frozen=True)
class NF4Case:
    rows: int
    shape: str
    nested: bool
    dtype: torch.dtype
    bias: bool
    knobs: tuple[tuple[str, int], ...] = ()


NF4_CASES = {
    "T1-96x128": NF4Case(1, "96x128", False, torch.float32, False),
    "T7-72x80-bias-dq": NF4Case(7, "72x80", True, torch.float32, True),
    "T32-40x33-fp16": NF4Case(32, "40x33", False, torch.float16, True),
    "T32-96x128-split3-fp16-dq": NF4Case(
        32, "96x128", True, torch.float16, True, (("split_k", 3), ("block_k", 32), ("block_n", 32))
    ),
    "T7-7x45-split2": NF4Case(7, "7x45", False, torch.float32, False, (("split_k", 2), ("block_k", 32))),
    "T5-48x256-bs128-k64": NF4Case(5, "48x256-bs128", True, torch.float32, True, (("block_k", 64),)),
    # above DECODE_ROWS: row blocks of 64, the last partial; forced through the kernel, not the dequant path
    "T300-72x80-tiled": NF4Case(300, "72x80", False, torch.float32, True, (("dequant_above", 10**6),)),
    "T300-96x128-dequant-mm-fp16": NF4Case(300, "96x128", True, torch.float16, True),
}


@pytest.mark.parametrize("case", NF4_CASES, ids=list(NF4_CASES))
def test_nf4_linear_is_x_times_the_dequantized_weight(case: str, device: torch.device) -> None:
    """y = x @ dequantize_4bit(W)^T + bias in x's dtype: in fp32 within fp32 rounding of the sum, in fp16
    within one fp16 rounding (the sums' order differs); x a strided view, out a strided view."""
    c = NF4_CASES[case]
    n, k, bs = NF4_SHAPES[c.shape]
    w = bnb_nf4(n, k, nested=c.nested, seed=41, blocksize=bs)
    x = randn(c.rows, k + 8, dtype=c.dtype, device=device, seed=42)[:, :k]
    bias = randn(n, dtype=c.dtype, device=device, seed=43) if c.bias else None
    out_buffer = torch.full((c.rows, n + 4), 9.0, dtype=c.dtype, device=device)
    knobs: dict[str, Any] = dict(c.knobs)
    got = nf4_linear(
        x, *nf4_args(w, device), out_features=n, in_features=k, blocksize=bs, bias=bias,
        out=out_buffer[:, :n], **knobs,
    )  # fmt: skip
    assert got.data_ptr() == out_buffer.data_ptr() and bool((out_buffer[:, n:] == 9.0).all())
    weight = w.dense.to(c.dtype).float()  # rounded to x's dtype, as bitsandbytes dequantizes for F.linear
    want = x.cpu().float() @ weight.t() + (0 if bias is None else bias.cpu().float())
    scale = (x.cpu().float().abs() @ weight.abs().t()).max().item()  # bounds the sum's rounding
    rtol = 0 if c.dtype == torch.float32 else 2**-10
    torch.testing.assert_close(got.cpu().float(), want.to(c.dtype).float(), atol=1e-5 * scale, rtol=rtol)


def test_nf4_linear_splits_decode_by_shape_alone() -> None:
    """Few N blocks: K is split (about two programs per SM); enough N blocks: not; never past K's steps."""
    cpu = torch.device("cpu")  # 132 SMs stand in
    assert default_split_k(32, 8, cpu) == 8  # bench-1b q/o (2048 x 2048): 32 blocks of 64
    assert default_split_k(32, 22, cpu) == 9  # down (5632 -> 2048)
    assert default_split_k(88, 8, cpu) == 3  # gate (2048 -> 5632)
    assert default_split_k(176, 8, cpu) == 1
    assert default_split_k(4, 1, cpu) == 1


def test_nf4_linear_rejects_what_it_cannot_read() -> None:
    w = bnb_nf4(72, 80, nested=True, seed=44)
    x = torch.ones(2, 80)
    args = dict(out_features=72, in_features=80, blocksize=64)
    with pytest.raises(ValueError, match="absmax must be"):
        nf4_linear(x, w.packed, w.absmax[:-1], w.code, **args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="packed must be"):
        nf4_linear(x, w.packed[:-1], w.absmax, w.code, **args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="x must be"):
        nf4_linear(x[:, :64], w.packed, w.absmax, w.code, **args)  # type: ignore[arg-type]


def _linear4bit(n: int, k: int, *, nested: bool, seed: int, dtype: torch.dtype, device: torch.device) -> Any:
    """A bitsandbytes nf4 Linear4bit with a bias, quantized by bitsandbytes on device."""
    bnb = pytest.importorskip("bitsandbytes")
    module = bnb.nn.Linear4bit(k, n, bias=True, compute_dtype=dtype, quant_type="nf4")
    original = randn(n, k, dtype=dtype, device=torch.device("cpu"), seed=seed)
    module.weight = bnb.nn.Params4bit(
        original, requires_grad=False, quant_type="nf4", blocksize=64, compress_statistics=nested
    )
    module.bias = torch.nn.Parameter(randn(n, dtype=dtype, device=torch.device("cpu"), seed=seed + 1))
    return module.to(device)


@pytest.mark.parametrize("grouped", [False, True], ids=["member-lora", "group-lora"])
def test_projection_runs_nf4_members_through_the_kernel(grouped: bool, device: torch.device) -> None:
    """A q/k/v-like group of bitsandbytes nf4 Linear4bit members (the first one, or all, wrapped for
    adapters; one double-quantized): with the kernel on, no member's own forward runs and each output is
    x @ its dequantized weight^T + bias plus its adapter's delta (each member's own LoRA kernel, or the
    group's Triton shrink/expand); with it off, the modules run themselves."""
    from deployments.engine.model.lora_layers import LoRAContext, MultiLoRALinear
    from deployments.engine.model.nf4_base import NF4Base
    from deployments.engine.model.projection import Projection

    bnbf = pytest.importorskip("bitsandbytes.functional")
    dtype, k, rows, rank = torch.float32, 128, 5, 16
    widths = [64, 32, 32]
    bases = [
        _linear4bit(n, k, nested=i == 1, seed=45 + 2 * i, dtype=dtype, device=device)
        for i, n in enumerate(widths)
    ]
    x = randn(rows, k, dtype=dtype, device=device, seed=51)
    wants = []
    for base in bases:  # K is a multiple of 64: bitsandbytes' CPU dequantization is right here
        dense = bnbf.dequantize_4bit(base.weight.data, base.weight.quant_state, quant_type="nf4")
        wants.append(x @ dense.to(dtype).t() + base.bias)
    context = LoRAContext()
    members: list[torch.nn.Module] = list(bases)
    for i in range(3 if grouped else 1):
        wrapper = MultiLoRALinear(
            bases[i], in_features=k, out_features=widths[i], pages=2, page_rank=rank, dtype=dtype,
            device=device, context=context,
        )  # fmt: skip
        a = randn(rank, k, dtype=dtype, device=device, seed=52 + i, scale=0.1)
        b = randn(widths[i], rank, dtype=dtype, device=device, seed=55 + i, scale=0.1)
        wrapper.load_slot(1, 1, a, b)
        wants[i][:3] += x[:3] @ a.t() @ b.t()  # rows 0..2 carry slot 1; rows 3, 4 no adapter
        members[i] = wrapper
    segments = [(1, 0, 3)]
    lora = LoRABatch(
        num_lora_tokens=3,
        offsets=torch.tensor([0, 3], dtype=torch.int32, device=device),
        segments=segments,
        segment_table=torch.tensor(segments, dtype=torch.int64),
    )
    context.batch = lora

    def refuse(*_: object) -> torch.Tensor:
        raise AssertionError("the module's own forward ran")

    for base in bases:
        base.forward = refuse
    projection = Projection(members, fuse_base=False, group_lora=grouped, nf4_kernel=True)
    assert all(isinstance(kernel, NF4Base) for kernel in projection.kernels)
    assert (projection.lora_a is not None) == grouped
    with torch.no_grad():
        got = projection(x, lora)
    for y, want in zip(got, wants, strict=True):
        torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-5)
    off = Projection(members, fuse_base=False, group_lora=grouped, nf4_kernel=False)
    assert off.kernels == [None, None, None]
    with pytest.raises(AssertionError, match="own forward ran"):
        off(x, lora)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_nf4_linear_on_bitsandbytes_cuda_weights_replays_in_a_cuda_graph() -> None:
    """Weights quantized by bitsandbytes' CUDA kernels (double quantization on), decode shape with K split
    (4 N blocks on a GPU of >= 4 SMs): equal to bitsandbytes' own Linear4bit forward up to bf16 rounding of
    the sum, and a captured call replayed on new x equals an eager call bit for bit."""
    from deployments.engine.model.nf4_base import NF4Base

    dev, dtype, rows, k, n = torch.device("cuda"), torch.bfloat16, 32, 2048, 256
    module = _linear4bit(n, k, nested=True, seed=60, dtype=dtype, device=dev)
    base = NF4Base.of(module)
    assert base is not None
    x = randn(rows, k, dtype=dtype, device=dev, seed=61)
    args = (x, base.packed, base.absmax, base.code)
    knobs = dict(out_features=n, in_features=k, blocksize=base.blocksize, bias=base.bias)
    out = torch.empty(rows, n, dtype=dtype, device=dev)
    with torch.no_grad():
        want = module(x)
    got = nf4_linear(*args, **knobs, out=out)  # type: ignore[arg-type]
    # bf16 rounding of the sum (ours once from fp32; bitsandbytes' GEMM its own way); a misread layout
    # would be off by the weights' whole size
    torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        nf4_linear(*args, **knobs, out=out)  # type: ignore[arg-type]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        nf4_linear(*args, **knobs, out=out)  # type: ignore[arg-type]
    x.copy_(randn(rows, k, dtype=dtype, device=dev, seed=62))
    graph.replay()
    replayed = out.clone()
    assert torch.equal(replayed, nf4_linear(*args, **knobs))  # type: ignore[arg-type]


def test_kernels_compile_for_sm90_without_a_gpu() -> None:
    """What the interpreter cannot show: the NF4 kernels lower to PTX and through ptxas for H100/H200 at the
    configurations nf4_linear launches, and a decode program keeps to a few KB of shared memory (Triton
    pipelining the code-table gathers through shared memory took 135 KB: one program per SM); so do the
    elementwise kernels' CUDA-only branches (libdevice's expf and tanhf, Gemma's unit-offset norm), and the
    group LoRA kernel, whose runs of pages the interpreter reads more leniently than the compiler."""
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(Path(triton.__file__).parents[1])])
    result = subprocess.run(
        [sys.executable, "-m", "tests.engine.sm90_compile"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    shared = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(shared) >= {
        "decode_split_partials", "decode_bias", "tiled_rows64", "split_sum", "dequant", "silu", "gelu_tanh",
        "gemma_norm", "lora_delta", "lora_delta_runs",
    }  # fmt: skip
    assert max(shared.values()) <= 48 * 1024, shared


# ----------------------------------------------------------------------------------- without Triton


def test_the_kernel_modules_import_without_triton() -> None:
    """A CPU-only engine may import them: they import, and a launcher says plainly what is missing."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from deployments.engine.model.gpu_kernels import activation, awq_dequant, awq_gemm, lora_sgmv\n"
        "from deployments.engine.model.gpu_kernels import nf4_gemm\n"
        "from deployments.engine.model.gpu_kernels import paged_attention, rms_norm, rotary_cache\n"
        "try:\n"
        "    rms_norm.rms_norm(torch.ones(1, 4), torch.ones(4), 1e-6)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "need Triton, which is not installed" in result.stdout


# ------------------------------------------------------------------------------------------ CUDA graph


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_the_kernels_replay_in_a_cuda_graph_with_new_metadata() -> None:
    """Captured once, replayed after the step's metadata changed in place (context lengths, block tables,
    positions, slots, LoRA segments): the same bits as eager calls. Capture itself fails on a host sync."""
    pytest.importorskip("triton")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    batch, heads, kv, dim, bs, width, hidden, inter, slots, rank = 4, 8, 2, 64, 16, 8, 128, 96, 3, 16
    qkv_src = randn(batch, (heads + 2 * kv) * dim, dtype=dtype, device=dev, seed=20)
    qkv = qkv_src.clone()
    q = qkv[:, : heads * dim].view(batch, heads, dim)
    k = qkv[:, heads * dim : (heads + kv) * dim].view(batch, kv, dim)
    v = qkv[:, (heads + kv) * dim :].view(batch, kv, dim)
    k_cache = randn(2 * batch * width * bs, kv, dim, dtype=dtype, device=dev, seed=21)
    v_cache = randn(2 * batch * width * bs, kv, dim, dtype=dtype, device=dev, seed=22)
    table = rotary_table(*(randn(4096, dim, dtype=dtype, device=dev, seed=s) for s in (23, 24)))
    tables = torch.zeros(batch, width, dtype=torch.int32, device=dev)
    lens = torch.zeros(batch, dtype=torch.int32, device=dev)
    positions = torch.zeros(batch, dtype=torch.int64, device=dev)
    slot_mapping = torch.zeros(batch, dtype=torch.int64, device=dev)
    x = randn(batch, hidden, dtype=dtype, device=dev, seed=25)
    residual = randn(batch, hidden, dtype=dtype, device=dev, seed=26)
    weight = randn(hidden, dtype=dtype, device=dev, seed=27)
    folded = 1.0 + weight.float()  # Gemma's (1 + w), as decoder_families.Norm keeps it
    gate_up = randn(batch, 2 * inter, dtype=dtype, device=dev, seed=28)
    a = randn(slots, hidden, 2 * rank, dtype=dtype, device=dev, seed=29, scale=0.1)
    b = randn(slots, rank, 2 * inter, dtype=dtype, device=dev, seed=30, scale=0.1)
    seg_ends = torch.zeros(slots, dtype=torch.int32, device=dev)
    packed = quantize_linear_weight(
        randn(inter, hidden, dtype=torch.float32, device=torch.device("cpu"), seed=31), 32
    )
    qweight, qzeros, scales = packed.qweight.to(dev), packed.qzeros.to(dev), packed.scales.to(dev)
    outs = {
        "attn_split": torch.empty(batch, heads, dim, dtype=dtype, device=dev),
        "attn": torch.empty(batch, heads, dim, dtype=dtype, device=dev),
        "norm": torch.empty(batch, hidden, dtype=dtype, device=dev),
        "residual": torch.empty(batch, hidden, dtype=dtype, device=dev),
        "act": torch.empty(batch, inter, dtype=dtype, device=dev),
        "gemma_norm": torch.empty(batch, hidden, dtype=dtype, device=dev),
        "gemma_residual": torch.empty(batch, hidden, dtype=dtype, device=dev),
        "gelu": torch.empty(batch, inter, dtype=dtype, device=dev),
        "h": torch.empty(batch, 2 * rank, device=dev),
        "y": torch.empty(batch, 2 * inter, dtype=dtype, device=dev),
        "y_fused": torch.empty(batch, 2 * inter, dtype=dtype, device=dev),
        "awq_y": torch.empty(batch, inter, dtype=torch.float16, device=dev),
    }

    def step() -> torch.Tensor:
        qkv.copy_(qkv_src)  # the rotary works in place: start each replay from the same input
        rotary_and_cache(q, k, v, table, positions, slot_mapping, k_cache, v_cache)
        for name, parts in (("attn_split", 4), ("attn", 1)):
            paged_decode_attention(
                q, k_cache, v_cache, tables, lens, block_size=bs, scale=0.125, sliding_window=50,
                out=outs[name], partitions=parts,
            )  # fmt: skip
        rms_norm(x, weight, 1e-5, residual, out=outs["norm"], residual_out=outs["residual"])
        silu_and_mul(gate_up, out=outs["act"])
        rms_norm(
            x, folded, 1e-6, residual, out=outs["gemma_norm"], residual_out=outs["gemma_residual"],
            unit_offset=True,
        )  # fmt: skip
        gelu_tanh_and_mul(gate_up, out=outs["gelu"])
        outs["h"].zero_()
        outs["y"].zero_()
        lora_shrink(x, a, seg_ends, outs["h"])
        lora_expand(outs["h"], b, seg_ends, outs["y"], splits=(inter, inter))
        outs["y_fused"].zero_()
        lora_delta(x, a, b, seg_ends, outs["y_fused"], splits=(inter, inter))
        awq_linear(x, qweight, qzeros, scales, 32, out=outs["awq_y"])
        return awq_dequantize(qweight, qzeros, scales, 32)

    def set_metadata(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        lens.copy_(torch.randint(0, width * bs + 1, (batch,), generator=gen))
        lens[0] = width * bs  # a full table
        tables.copy_(torch.randperm(2 * batch * width, generator=gen)[: batch * width].view(batch, width))
        positions.copy_(torch.randint(0, 4096, (batch,), generator=gen))
        slot_mapping.copy_(torch.randperm(k_cache.shape[0], generator=gen)[:batch])
        slot_mapping[-1] = -1
        cuts = torch.randint(0, batch + 1, (slots,), generator=gen).sort().values
        seg_ends.copy_(cuts)

    set_metadata(0)
    graph, dequantized = captured(step)
    for seed in (1, 2):
        set_metadata(seed)
        cache_before = k_cache.clone(), v_cache.clone()
        graph.replay()
        replayed = {name: t.clone() for name, t in outs.items()} | {"awq": dequantized.clone()}
        replayed_cache = k_cache.clone(), v_cache.clone()
        k_cache.copy_(cache_before[0])
        v_cache.copy_(cache_before[1])
        eager = step()
        for name, t in outs.items():
            assert torch.equal(replayed[name], t), name
        assert torch.equal(replayed["awq"], eager)
        assert torch.equal(replayed_cache[0], k_cache) and torch.equal(replayed_cache[1], v_cache)
