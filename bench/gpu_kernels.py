"""The GPU engine's Triton kernels (deployments/engine/model/gpu_kernels) against the torch code they replace.

One decode step's calls of one layer of bench-1b (TinyLlama-1.1B's shape: hidden 2048, 32 heads, 4 kv heads,
head_dim 64, intermediate 5632) at batch 32 with 16 rank-16 adapters, each kernel against its torch peer:
  attention:   paged_decode_attention (split-K chosen from the shapes, and unsplit) vs the engine's decode
               path today (whole blocks gathered out of the cache, masked SDPA), per context length;
  attention_prefill: one layer's attention of a prefill step of --prompts prompts of 96-160 tokens
               through attention.attend: paged_prefill_attention (every chunk in one launch) vs the split
               path (one SDPA call per prompt); `attention_prefill_cached`: the same chunks after a
               256-token cached prefix (the split path then also gathers each span's blocks and builds its
               mask); `attention_decode_rows`: the batch's decode rows at the first --contexts length as
               chunks of one token in the prefill kernel (how a mixed step runs them) and through the
               decode kernel (`ours_decode_kernel`), both against the split path's gathered SDPA;
  rotary:      rotary_and_cache vs HF apply_rotary_pos_emb + the two cache index_copy_ calls;
  rms_norm:    the fused residual add + RMSNorm vs HF's (residual + x, LlamaRMSNorm);
  silu_mul:    silu_and_mul vs F.silu(gate) * up;
  gemma_norm:  the fused residual add + Gemma's (1 + w) RMSNorm vs HF's (residual + x, Gemma3RMSNorm);
  gelu_mul:    gelu_tanh_and_mul vs F.gelu(gate, approximate="tanh") * up (Gemma's GeGLU);
  lora_qkv, lora_o, lora_gate_up, lora_down (decode: the batch's tokens; _prefill: 4096 tokens), each
               spread evenly over the adapters: our fused kernel (lora_delta, one launch a group) and our
               shrink + expand pair (`_pair`) vs today's LoRA kernel called once per member module
               (lora_kernels.select_kernel: grouped_mm on sm90 bf16). `lora_fused_vs_pair`: pair / fused
               time (above 1: the fused kernel is faster); `lora_layer_us`: a layer's four groups summed
               (times 22 layers: bench-1b's LoRA cost a step);
  awq_dequant: awq_dequantize of the gate projection vs the same dequantization in torch ops;
  awq_linear:  the fused int4 GEMM awq_linear at the batch vs torch dequantization + matmul (also: our
               dequantization + matmul, and the dense bf16 matmul, for scale).
  nf4_qkv, nf4_gate_up, nf4_down: a bitsandbytes nf4 Linear4bit (2048->2560, 2048->11264, 5632->2048)
               at the batch: our nf4_linear vs the module's own forward (bitsandbytes 0.50: dequantize to
               16 bits, then a GEMM), and the dense matmul in the compute dtype for scale;
  nf4_prefill: the gate/up linear at --prefill-rows rows: the module vs ours (dequantize + dense GEMM
               above DEQUANT_ABOVE rows) vs our GEMM kernel forced at that size (CUDA only).
Peers run in turns (bench.measure.Interleaved); each sample is the mean of --iters calls timed with CUDA
events, both replayed from a CUDA graph of --iters calls (`graph`: device time, as the captured decode
step runs them) and launched eagerly (`eager`: the host's launch cost included; Triton's Python launcher
costs tens of microseconds, more than most of these kernels run). `ratios` are torch / ours from the graph
replays (above 1: ours is faster), `ratios_eager` from the eager calls; medians of per-round ratios.

Run:  python -m bench.gpu_kernels [--contexts 1024,4096] [--repeats 7] [--iters 50]   (CUDA)
      python -m bench.gpu_kernels --only lora   (CUDA: the LoRA groups alone)
      python -m bench.gpu_kernels --sweep [lora]  (CUDA: graph times over the kernels' tuning knobs)
      python -m bench.gpu_kernels --tiny   (tiny shapes; through Triton's interpreter where no CUDA exists)
The last line is one JSON object.
"""

import argparse
import importlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, cast

import torch
import torch.nn.functional as F

from bench.measure import Interleaved, machine


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    batch: int
    adapters: int
    rank: int
    block_size: int
    prefill_tokens: int  # a prefill step's tokens (the LoRA kernels' other regime)


BENCH_1B = Shape(hidden=2048, heads=32, kv_heads=4, head_dim=64, inter=5632, batch=32, adapters=16, rank=16,
                 block_size=16, prefill_tokens=4096)  # fmt: skip
TINY = Shape(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=64, batch=2, adapters=2, rank=16,
             block_size=4, prefill_tokens=300)  # fmt: skip


def timer(fn: Callable[[], object], iters: int, cuda: bool) -> float:
    """Microseconds per call, the mean over `iters` back-to-back calls (host launch cost included)."""
    if cuda:
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) * 1000 / iters
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - begin) * 1e6 / iters


def graphed(fn: Callable[[], object], iters: int) -> Callable[[], object] | None:
    """`iters` calls of fn captured in one CUDA graph (as the engine's decode replays them): replaying it
    costs device time only. None when fn cannot be captured."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
    except RuntimeError as exc:
        print(f"not capturable: {exc}", flush=True)
        return None
    return graph.replay


def graph_timer(replay: Callable[[], object], iters: int) -> float:
    """Microseconds per captured call."""
    return timer(replay, 1, True) / iters


def attention_peers(
    s: Shape, context: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Callable[[], object]]:
    from deployments.engine.model.attention import _gather_blocks
    from deployments.engine.model.gpu_kernels.paged_attention import paged_decode_attention

    width = -(-context // s.block_size)
    num_blocks = s.batch * width
    q = torch.randn(s.batch, s.heads, s.head_dim, dtype=dtype, device=device)
    k_cache = torch.randn(num_blocks * s.block_size, s.kv_heads, s.head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device=device).view(s.batch, width).int()
    lens = torch.full((s.batch,), context, dtype=torch.int32, device=device)
    scale = s.head_dim**-0.5
    mask = (torch.arange(width * s.block_size, device=device)[None] < lens[:, None])[:, None, None, :]
    out = torch.empty_like(q)

    def engine_today() -> None:
        k = _gather_blocks(k_cache, tables, s.block_size).transpose(1, 2)  # [B, Hkv, L, D]
        v = _gather_blocks(v_cache, tables, s.block_size).transpose(1, 2)
        F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    run = partial(paged_decode_attention, q, k_cache, v_cache, tables, lens, block_size=s.block_size,
                  scale=scale, out=out)  # fmt: skip
    return {
        "torch": engine_today,
        "ours": run,
        "ours_unsplit": partial(run, partitions=1),
        "ours_split2": partial(run, partitions=2),
    }


def prefill_peers(
    s: Shape, lengths: list[int], cached: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Callable[[], object]]:
    """One layer's attention over chunks of `lengths` new tokens, each after `cached` cached positions, as
    attention.attend runs it: split (TorchOps: decode rows batched, one SDPA call per span) and as chunks
    (TritonOps: one launch). Chunks of one token are decode rows."""
    from deployments.engine.model.attention import AttentionMetadata, PrefillSpan, StepChunks, attend
    from deployments.engine.model.gpu_kernels.paged_attention import paged_decode_attention
    from deployments.engine.model.gpu_kernels.prefill_attention import paged_prefill_attention

    bs, n = s.block_size, len(lengths)
    width = -(-(cached + max(lengths)) // bs)
    t = sum(lengths)
    starts = [sum(lengths[:i]) for i in range(n)]
    qkv = torch.randn(t, (s.heads + 2 * s.kv_heads) * s.head_dim, dtype=dtype, device=device)
    q = qkv[:, : s.heads * s.head_dim].view(t, s.heads, s.head_dim)
    k_new = qkv[:, s.heads * s.head_dim : (s.heads + s.kv_heads) * s.head_dim].view(t, s.kv_heads, s.head_dim)
    v_new = qkv[:, (s.heads + s.kv_heads) * s.head_dim :].view(t, s.kv_heads, s.head_dim)
    k_cache = torch.randn(n * width * bs, s.kv_heads, s.head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(n * width, device=device).view(n, width)
    column = partial(torch.tensor, dtype=torch.int64, device=device)
    decode = [i for i in range(n) if lengths[i] == 1]
    split = AttentionMetadata(
        kv_caches=[], block_size=bs, slot_mapping=column(range(t)),
        decode_token_index=column([starts[i] for i in decode]) if decode else None,
        decode_block_table=tables[decode] if decode else None,
        decode_context_lens=column([cached + 1] * len(decode)) if decode else None,
        prefills=[
            PrefillSpan(starts[i], lengths[i], cached + lengths[i],
                        tables[i, : -(-(cached + lengths[i]) // bs)] if cached else None)
            for i in range(n) if lengths[i] > 1
        ],
        all_decode=len(decode) == n, decode_width=width,
    )  # fmt: skip
    chunks = StepChunks(
        query_start=column(starts), query_len=column(lengths),
        context_len=column([cached + m for m in lengths]), block_tables=tables,
    )  # fmt: skip
    as_chunks = replace(split, chunks=chunks)
    scale = s.head_dim**-0.5
    run = partial(attend, q, k_new, v_new, k_cache, v_cache, scale=scale, window=None)
    peers: dict[str, Callable[[], object]] = {
        "torch": partial(run, split),  # the mask cache (_masks) persists: as within one step's layers
        "ours": partial(run, as_chunks, paged_prefill=paged_prefill_attention),
    }
    if len(decode) == n:
        peers["ours_decode_kernel"] = partial(run, split, paged=paged_decode_attention)
    return peers


def rotary_peers(s: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Callable[[], object]]:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from deployments.engine.model.gpu_kernels.rotary_cache import rotary_and_cache, rotary_table

    max_pos, t = 4096, s.batch
    qkv = torch.randn(t, (s.heads + 2 * s.kv_heads) * s.head_dim, dtype=dtype, device=device)
    q = qkv[:, : s.heads * s.head_dim].view(t, s.heads, s.head_dim)
    k = qkv[:, s.heads * s.head_dim : (s.heads + s.kv_heads) * s.head_dim].view(t, s.kv_heads, s.head_dim)
    v = qkv[:, (s.heads + s.kv_heads) * s.head_dim :].view(t, s.kv_heads, s.head_dim)
    angles = torch.rand(max_pos, s.head_dim, device=device)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    table = rotary_table(cos, sin)
    positions = torch.randint(0, max_pos, (t,), device=device)
    slots = torch.randperm(4 * t, device=device)[:t]
    k_cache = torch.zeros(4 * t, s.kv_heads, s.head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)

    def hf() -> None:  # as the engine runs it today: HF's rotary in the model, then attention.py's writes
        _, k_r = apply_rotary_pos_emb(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[positions][None], sin[positions][None]
        )
        k_cache.index_copy_(0, slots, k_r[0].transpose(0, 1))
        v_cache.index_copy_(0, slots, v)

    ours = partial(rotary_and_cache, q, k, v, table, positions, slots, k_cache, v_cache)
    return {"torch": hf, "ours": ours}


def rms_norm_peers(s: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Callable[[], object]]:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from deployments.engine.model.gpu_kernels.rms_norm import rms_norm

    norm = LlamaRMSNorm(s.hidden, eps=1e-5).to(device=device, dtype=dtype)
    x = torch.randn(s.batch, s.hidden, dtype=dtype, device=device)
    residual = torch.randn_like(x)
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    return {
        "torch": lambda: norm(residual + x),
        "ours": partial(rms_norm, x, norm.weight, 1e-5, residual, out=out, residual_out=residual_out),
    }


def silu_peers(s: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Callable[[], object]]:
    from deployments.engine.model.gpu_kernels.activation import silu_and_mul

    gate_up = torch.randn(s.batch, 2 * s.inter, dtype=dtype, device=device)
    out = torch.empty(s.batch, s.inter, dtype=dtype, device=device)
    return {
        "torch": lambda: F.silu(gate_up[:, : s.inter]) * gate_up[:, s.inter :],
        "ours": partial(silu_and_mul, gate_up, out),
    }


def gemma_norm_peers(s: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Callable[[], object]]:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from deployments.engine.model.gpu_kernels.rms_norm import rms_norm

    norm = Gemma3RMSNorm(s.hidden, eps=1e-6).to(device=device, dtype=dtype)
    folded = (1.0 + norm.weight.detach().float()).contiguous()  # as decoder_families.Norm keeps it
    x = torch.randn(s.batch, s.hidden, dtype=dtype, device=device)
    residual = torch.randn_like(x)
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    ours = partial(rms_norm, x, folded, 1e-6, residual, out=out, residual_out=residual_out, unit_offset=True)
    return {"torch": lambda: norm(residual + x), "ours": ours}


def gelu_peers(s: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Callable[[], object]]:
    from deployments.engine.model.gpu_kernels.activation import gelu_tanh_and_mul

    gate_up = torch.randn(s.batch, 2 * s.inter, dtype=dtype, device=device)
    out = torch.empty(s.batch, s.inter, dtype=dtype, device=device)
    return {
        "torch": lambda: F.gelu(gate_up[:, : s.inter], approximate="tanh") * gate_up[:, s.inter :],
        "ours": partial(gelu_tanh_and_mul, gate_up, out),
    }


def lora_peers(
    s: Shape,
    in_features: int,
    splits: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    tokens: int | None = None,
) -> dict[str, Callable[[], object]]:
    """One projection group's adapters over `tokens` (default: the decode batch) spread evenly over the
    adapters: today's per-member kernel, our fused one-launch kernel, and our shrink + expand pair."""
    from deployments.engine.model.gpu_kernels.lora_delta import lora_delta
    from deployments.engine.model.gpu_kernels.lora_sgmv import lora_expand, lora_shrink
    from deployments.engine.model.lora_kernels import LoRABatch, select_kernel

    t = tokens or s.batch
    per = t // s.adapters
    segments = [(a, a * per, (a + 1) * per) for a in range(s.adapters)]
    batch = LoRABatch(
        num_lora_tokens=per * s.adapters,
        offsets=torch.tensor([e for _, _, e in segments], dtype=torch.int32, device=device),
        segments=segments,
        segment_table=torch.tensor(segments, dtype=torch.int64),
    )
    members = len(splits)
    x = torch.randn(t, in_features, dtype=dtype, device=device)
    a = torch.randn(s.adapters, in_features, members * s.rank, dtype=dtype, device=device) * 0.02
    b = torch.randn(s.adapters, s.rank, sum(splits), dtype=dtype, device=device) * 0.02
    y = torch.zeros(t, sum(splits), dtype=dtype, device=device)
    # Today: one module per member, each with its own contiguous slot tensors.
    starts = [sum(splits[:p]) for p in range(members)]
    member_a = [a[:, :, p * s.rank : (p + 1) * s.rank].contiguous() for p in range(members)]
    member_b = [b[:, :, c : c + w].contiguous() for c, w in zip(starts, splits, strict=True)]
    member_y = [torch.zeros(t, w, dtype=dtype, device=device) for w in splits]
    _, kernel = select_kernel(dtype, device, {in_features, *splits, s.rank})
    h = torch.empty(t, members * s.rank, dtype=torch.float32, device=device)

    def today() -> None:
        for p in range(members):
            kernel(member_y[p], x, member_a[p], member_b[p], batch)

    def pair() -> None:
        lora_shrink(x, a, batch.offsets, h)
        lora_expand(h, b, batch.offsets, y, splits=splits)

    return {
        "torch": today,
        "ours": partial(lora_delta, x, a, b, batch.offsets, y, splits=splits),
        "ours_pair": pair,
    }


def lora_groups(
    s: Shape, dtype: torch.dtype, device: torch.device
) -> dict[str, dict[str, Callable[[], object]]]:
    """The four LoRA groups of a layer (all-linear adapters) at decode and at prefill."""
    shapes = {
        "qkv": (s.hidden, (s.heads * s.head_dim, *(2 * [s.kv_heads * s.head_dim]))),
        "o": (s.heads * s.head_dim, (s.hidden,)),
        "gate_up": (s.hidden, (s.inter, s.inter)),
        "down": (s.inter, (s.hidden,)),
    }
    groups: dict[str, dict[str, Callable[[], object]]] = {}
    for suffix, tokens in (("", s.batch), ("_prefill", s.prefill_tokens)):
        for name, (k, splits) in shapes.items():
            groups[f"lora_{name}{suffix}"] = lora_peers(s, k, splits, dtype, device, tokens)
    return groups


def awq_peers(
    s: Shape, dtype: torch.dtype, device: torch.device
) -> dict[str, dict[str, Callable[[], object]]]:
    """The gate projection's weights in AWQ int4: dequantization alone, and the whole linear at the batch."""
    from deployments.engine.model.gpu_kernels.awq_dequant import awq_dequantize
    from deployments.engine.model.gpu_kernels.awq_gemm import awq_linear

    group, k, n = 128 if s.hidden >= 128 else 16, s.hidden, s.inter
    qweight = torch.randint(-(2**31), 2**31 - 1, (k, n // 8), dtype=torch.int32, device=device)
    qzeros = torch.randint(-(2**31), 2**31 - 1, (k // group, n // 8), dtype=torch.int32, device=device)
    scales = (torch.rand(k // group, n, device=device) * 0.01).to(dtype)
    shifts = torch.tensor([0, 16, 4, 20, 8, 24, 12, 28], device=device)
    x = torch.randn(s.batch, k, dtype=dtype, device=device)
    dense = torch.randn(k, n, dtype=dtype, device=device)
    out = torch.empty(s.batch, n, dtype=dtype, device=device)

    def torch_dequant() -> torch.Tensor:
        codes = ((qweight[..., None] >> shifts) & 0xF).flatten(1)
        zeros = ((qzeros[..., None] >> shifts) & 0xF).flatten(1).repeat_interleave(group, 0)
        return ((codes - zeros) * scales.repeat_interleave(group, 0)).to(dtype)

    dequant = partial(awq_dequantize, qweight, qzeros, scales, group)
    return {
        "awq_dequant": {"torch": torch_dequant, "ours": dequant},
        # torch: dequantize in torch ops, then matmul; dense: the bf16 weight's own matmul, for scale
        "awq_linear": {
            "torch": lambda: x @ torch_dequant(),
            "ours": partial(awq_linear, x, qweight, qzeros, scales, group, out=out),
            "ours_dequant_mm": lambda: x @ dequant(),
            "dense": lambda: x @ dense,
        },
    }


def nf4_module(k: int, n: int, dtype: torch.dtype, device: torch.device) -> Any:
    """A bitsandbytes nf4 Linear4bit as our loader builds it (no double quantization), quantized by
    bitsandbytes on the device."""
    bnb: Any = importlib.import_module("bitsandbytes")  # untyped
    module = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=dtype, quant_type="nf4")
    weight = torch.randn(n, k, dtype=dtype) * 0.02
    module.weight = bnb.nn.Params4bit(
        weight, requires_grad=False, quant_type="nf4", blocksize=64, compress_statistics=False
    )
    return module.to(device).eval()


def nf4_peers(
    shapes: dict[str, tuple[int, int, int]], dtype: torch.dtype, device: torch.device
) -> dict[str, dict[str, Callable[[], object]]]:
    """Per name (rows, in, out): the module's forward, ours, and the dense matmul; `_kernel` forces our
    GEMM kernel past DEQUANT_ABOVE rows."""
    from deployments.engine.model.gpu_kernels.nf4_gemm import nf4_linear
    from deployments.engine.model.nf4_base import NF4Base

    groups: dict[str, dict[str, Callable[[], object]]] = {}
    for name, (rows, k, n) in shapes.items():
        module = nf4_module(k, n, dtype, device)
        base = NF4Base.of(module)
        assert base is not None
        x = torch.randn(rows, k, dtype=dtype, device=device)
        out = torch.empty(rows, n, dtype=dtype, device=device)
        dense = torch.randn(n, k, dtype=dtype, device=device)
        ours = partial(
            nf4_linear, x, base.packed, base.absmax, base.code, out_features=n, in_features=k,
            blocksize=base.blocksize, out=out,
        )  # fmt: skip
        groups[name] = {
            "torch": partial(module, x),
            "ours": ours,
            **({"ours_kernel": partial(ours, dequant_above=2**31)} if "prefill" in name else {}),
            "dense": partial(F.linear, x, dense),
        }
    return groups


def nf4_groups(
    s: Shape,
    prefill_rows: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    tiny: bool,
    result: dict[str, Any],
) -> dict[str, dict[str, Callable[[], object]]]:
    """bench-1b's nf4 linears at the batch (q/k/v, gate/up, down), and gate/up at prefill on CUDA."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        result["nf4"] = "skipped: bitsandbytes is not installed"
        return {}
    qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
    shapes = {
        "nf4_qkv": (s.batch, s.hidden, qkv),
        "nf4_gate_up": (s.batch, s.hidden, 2 * s.inter),
        "nf4_down": (s.batch, s.inter, s.hidden),
    }
    if not tiny:
        shapes["nf4_prefill"] = (prefill_rows, s.hidden, 2 * s.inter)
    return nf4_peers(shapes, dtype, device)


def sweep(s: Shape, dtype: torch.dtype) -> dict[str, dict[str, float]]:
    """Graph-replayed microseconds of each kernel knob setting: what the defaults were chosen from."""
    from deployments.engine.model.gpu_kernels.awq_gemm import awq_linear
    from deployments.engine.model.gpu_kernels.prefill_attention import paged_prefill_attention

    device = torch.device("cuda")
    found: dict[str, dict[str, float]] = {}
    for batch in (8, 32, 128):
        for context in (1024, 4096):
            peers = attention_peers(Shape(**{**vars(s), "batch": batch}), context, dtype, device)
            run = cast(Callable[..., object], peers["ours"])  # a partial of paged_decode_attention
            row = found[f"attention_B{batch}_ctx{context}"] = {}
            for block_n in (32, 64, 128):
                for parts in (1, 2, 4, 8, 16):
                    replay = graphed(partial(run, partitions=parts, block_n=block_n), 20)
                    if replay is not None:
                        row[f"n{block_n}_p{parts}"] = round(graph_timer(replay, 20), 1)
            print(f"attention B={batch} ctx={context}", row, flush=True)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(96, 161, (32,), generator=gen).tolist()
    for cached in (0, 256):
        peers = prefill_peers(s, lengths, cached, dtype, device)
        as_chunks = cast(Callable[..., object], peers["ours"])  # a partial of attention.attend
        row = found[f"prefill_cached{cached}"] = {}
        for block_m in (32, 64, 128):
            for block_n in (32, 64, 128):
                knobs = partial(paged_prefill_attention, block_m=block_m, block_n=block_n)
                replay = graphed(partial(as_chunks, paged_prefill=knobs), 20)
                if replay is not None:
                    row[f"m{block_m}_n{block_n}"] = round(graph_timer(replay, 20), 1)
        print(f"prefill cached={cached}", row, flush=True)
    group = 128
    for m, k, n in (
        (8, s.hidden, s.hidden),
        (32, s.hidden, s.inter),
        (32, s.inter, s.hidden),
        (256, s.hidden, s.inter),
    ):
        qweight = torch.randint(-(2**31), 2**31 - 1, (k, n // 8), dtype=torch.int32, device=device)
        qzeros = torch.randint(-(2**31), 2**31 - 1, (k // group, n // 8), dtype=torch.int32, device=device)
        scales = (torch.rand(k // group, n, device=device) * 0.01).to(dtype)
        x = torch.randn(m, k, dtype=dtype, device=device)
        out = torch.empty(m, n, dtype=dtype, device=device)
        dense = torch.randn(k, n, dtype=dtype, device=device)
        row = found[f"awq_linear_M{m}_K{k}_N{n}"] = {}
        replay = graphed(partial(torch.matmul, x, dense), 20)
        row["dense"] = round(graph_timer(replay, 20), 1) if replay else float("nan")
        for split in (1, 4, 8, 16):
            for block_n, block_k in ((32, 128), (64, 64), (64, 128), (128, 64), (128, 128)):
                for warps in (4, 8):
                    fn = partial(awq_linear, x, qweight, qzeros, scales, group, out=out, split_k=split,
                                 block_n=block_n, block_k=block_k, num_warps=warps)  # fmt: skip
                    replay = graphed(fn, 20)
                    if replay is not None:
                        row[f"s{split}_n{block_n}_k{block_k}_w{warps}"] = round(graph_timer(replay, 20), 1)
        print(f"awq_linear M={m} K={k} N={n}", row, flush=True)
    found.update(lora_sweep(s, dtype, device))
    found.update(nf4_sweep(s, dtype))
    return found


def _powers(first: int, cover: int) -> list[int]:
    """first, 2 first, ... up to the first that reaches `cover`."""
    found = [first]
    while found[-1] < cover:
        found.append(2 * found[-1])
    return found


def lora_sweep(s: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, dict[str, float]]:
    """lora_delta's column chunk (programs vs re-reads of A and the x tile) per group and regime, the
    default (delta_config's cost model) marked."""
    from dataclasses import replace

    from triton.runtime.errors import OutOfResources

    from deployments.engine.model.gpu_kernels.lora_delta import DeltaShape, delta_config, sm_count

    found: dict[str, dict[str, float]] = {}
    for name, peers in lora_groups(s, dtype, device).items():
        run = cast(partial[object], peers["ours"])  # a partial of lora_delta
        x, a, b, _, y = run.args
        splits = run.keywords["splits"]
        default = delta_config(
            DeltaShape(x.shape[0], a.shape[0], splits, x.shape[1], b.shape[1], x.element_size(),
                       b.element_size(), y.element_size(), sm_count(device))
        )  # fmt: skip
        row = found[f"{name}_T{x.shape[0]}"] = {"default_columns": float(default.columns)}
        trials = {f"c{c}": replace(default, columns=c) for c in _powers(default.block_n, max(splits))}
        trials.update(  # K steps and pipeline depth at the default chunk
            {
                f"k{k}_s{st}": replace(default, block_k=k, num_stages=st)
                for k, st in ((64, 3), (128, 3), (256, 3), (256, 4), (512, 3))
            }
        )
        for label, config in trials.items():
            try:
                replay = graphed(partial(run, config=config), 20)
            except OutOfResources:  # a knob past this GPU's shared memory
                print(f"{name} {label}: out of shared memory", flush=True)
                continue
            if replay is not None:
                row[label] = round(graph_timer(replay, 20), 1)
        print(name, row, flush=True)
    return found


def layer_lora_us(kernels: dict[str, Any], mode: str) -> dict[str, float]:
    """One layer's four LoRA groups (all-linear adapters) summed, per regime and peer, where all ran."""
    found: dict[str, float] = {}
    for regime, suffix in (("decode", ""), ("prefill", "_prefill")):
        times = [kernels.get(f"lora_{g}{suffix}", {}) for g in ("qkv", "o", "gate_up", "down")]
        for peer in ("torch", "ours", "ours_pair"):
            if all(f"{peer}:{mode}" in t for t in times):
                found[f"{regime}_{peer}"] = round(sum(t[f"{peer}:{mode}"] for t in times), 2)
    return found


def nf4_sweep(s: Shape, dtype: torch.dtype) -> dict[str, dict[str, float]]:
    from deployments.engine.model.gpu_kernels.nf4_gemm import nf4_linear
    from deployments.engine.model.nf4_base import NF4Base

    device = torch.device("cuda")
    found: dict[str, dict[str, float]] = {}
    for m, k, n in (
        (32, s.hidden, 2560),
        (32, s.hidden, 2 * s.inter),
        (32, s.inter, s.hidden),
        (8, s.hidden, 256),
    ):
        base = NF4Base.of(nf4_module(k, n, dtype, device))
        assert base is not None
        x = torch.randn(m, k, dtype=dtype, device=device)
        out = torch.empty(m, n, dtype=dtype, device=device)
        row = found[f"nf4_linear_M{m}_K{k}_N{n}"] = {}
        for split in (1, 2, 4, 8):
            for block_n, block_k in ((32, 128), (64, 128), (64, 256), (128, 128)):
                for warps, stages in ((8, 1), (4, 1), (8, 2)):
                    fn = partial(nf4_linear, x, base.packed, base.absmax, base.code, out_features=n,
                                 in_features=k, blocksize=base.blocksize, out=out, split_k=split,
                                 block_n=block_n, block_k=block_k, num_warps=warps,
                                 num_stages=stages)  # fmt: skip
                    replay = graphed(fn, 20)
                    if replay is not None:
                        key = f"s{split}_n{block_n}_k{block_k}_w{warps}_st{stages}"
                        row[key] = round(graph_timer(replay, 20), 1)
        print(f"nf4_linear M={m} K={k} N={n}", row, flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", default="1024,4096", help="comma-separated decode context lengths")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--prompts", type=int, default=32, help="prompts in the prefill step")
    parser.add_argument("--repeats", type=int, default=7, help="rounds of every peer")
    parser.add_argument("--iters", type=int, default=50, help="calls per timed sample")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, one round: checks the bench runs")
    parser.add_argument("--prefill-rows", type=int, default=1024, help="rows of the nf4_prefill entry")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated prefixes of the groups to run (e.g. `lora`: the LoRA groups alone)",
    )
    parser.add_argument(
        "--sweep",
        nargs="?",
        const="all",
        choices=["all", "lora"],
        help="CUDA: graph times of the tuning knobs (attention, awq_linear, lora_delta; or lora_delta's "
        "only) instead",
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.tiny:
            parser.error("the GPU kernels bench needs CUDA (or --tiny, which runs Triton's CPU interpreter)")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of Triton
    from deployments.engine.model.gpu_kernels._triton import triton

    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)"}
    if triton is None:
        result.update(
            skipped="Triton is not installed", kernels_us={}, ratios={}, machine=machine(args.dtype)
        )
        print(json.dumps(result))
        return
    if args.sweep and cuda:
        dtype = getattr(torch, args.dtype)
        if args.sweep == "lora":
            result["sweep"] = lora_sweep(BENCH_1B, dtype, torch.device("cuda"))
        else:
            result["sweep"] = sweep(BENCH_1B, dtype)
        result["machine"] = machine(args.dtype)
        print(json.dumps(result))
        return
    shape, device = (TINY, torch.device("cpu")) if args.tiny else (BENCH_1B, torch.device("cuda"))
    dtype = torch.float32 if args.tiny else getattr(torch, args.dtype)  # the interpreter's dot: fp32/fp16
    contexts = [32] if args.tiny else [int(c) for c in args.contexts.split(",")]
    repeats, iters = (1, 1) if args.tiny else (args.repeats, args.iters)
    torch.manual_seed(0)
    s = shape
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(96, 161, (args.prompts,), generator=gen).tolist()
    if args.tiny:  # the interpreter runs each program in Python
        lengths = [5, 9][: args.prompts]
    cached = 8 if args.tiny else 256
    groups: dict[str, dict[str, Callable[[], object]]] = {
        **{f"attention_ctx{c}": attention_peers(s, c, dtype, device) for c in contexts},
        "attention_prefill": prefill_peers(s, lengths, 0, dtype, device),
        "attention_prefill_cached": prefill_peers(s, lengths, cached, dtype, device),
        "attention_decode_rows": prefill_peers(s, [1] * s.batch, contexts[0] - 1, dtype, device),
        "rotary": rotary_peers(s, dtype, device),
        "rms_norm": rms_norm_peers(s, dtype, device),
        "silu_mul": silu_peers(s, dtype, device),
        "gemma_norm": gemma_norm_peers(s, dtype, device),
        "gelu_mul": gelu_peers(s, dtype, device),
        **lora_groups(s, dtype, device),
        **awq_peers(s, dtype, device),
    }  # fmt: skip
    groups.update(nf4_groups(s, args.prefill_rows, dtype, device, tiny=args.tiny, result=result))
    if args.only:
        prefixes = tuple(args.only.split(","))
        groups = {name: peers for name, peers in groups.items() if name.startswith(prefixes)}
    from deployments.engine.model.gpu_kernels.paged_attention import num_partitions

    result["attention_partitions"] = {
        c: num_partitions(s.batch, s.kv_heads, -(-c // s.block_size) * s.block_size, device) for c in contexts
    }
    kernels: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    ratios_eager: dict[str, float] = {}
    fused_vs_pair: dict[str, float] = {}
    kept = "graph" if cuda else "eager"  # the times the summaries below use
    for name, peers in groups.items():
        for fn in peers.values():  # warm: compiles every kernel variant
            fn()
        timed: dict[str, Callable[[], float]] = {
            f"{p}:eager": partial(timer, fn, iters, cuda) for p, fn in peers.items()
        }
        if cuda:
            torch.cuda.synchronize()
            for p, fn in peers.items():
                replay = graphed(fn, iters)
                if replay is not None:
                    timed[f"{p}:graph"] = partial(graph_timer, replay, iters)
        runs = Interleaved(timed, repeats=repeats).run()
        kernels[name] = {key: round(runs.median(key), 2) for key in timed}
        for key in timed:
            peer, mode = key.split(":")
            if peer == "torch" or f"torch:{mode}" not in timed:
                continue
            label = name if peer == "ours" else f"{name}_{peer.removeprefix('ours_')}"  # torch / that peer
            ratio = round(runs.ratio(f"torch:{mode}", key)["median"], 2)
            (ratios if mode == "graph" or not cuda else ratios_eager)[label] = ratio
        if f"ours_pair:{kept}" in timed and f"ours:{kept}" in timed:
            fused_vs_pair[name] = round(runs.ratio(f"ours_pair:{kept}", f"ours:{kept}")["median"], 2)
        print(name, kernels[name], flush=True)
    lora_layer_us = layer_lora_us(kernels, kept)
    result.update(
        dtype=str(dtype).removeprefix("torch."), shape=vars(s), contexts=contexts, prompt_lengths=lengths,
        prefill_cached=cached, repeats=repeats,
        iters=iters, kernels_us=kernels, ratios=ratios, ratios_eager=ratios_eager,
        lora_fused_vs_pair=fused_vs_pair, lora_layer_us=lora_layer_us,
        machine=machine(str(dtype).removeprefix("torch.")),
    )  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
