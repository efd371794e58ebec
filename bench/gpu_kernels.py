"""The GPU engine's Triton kernels (deployments/engine/gpu_kernels) against the torch code they replace.

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
  lora_qkv, lora_gate_up, lora_down: one shrink + one expand (fused members) vs today's LoRA kernel called
               once per member module (lora_kernels.select_kernel: grouped_mm on sm90 bf16);
  awq_dequant: awq_dequantize of the gate projection vs the same dequantization in torch ops;
  awq_linear:  the fused int4 GEMM awq_linear at the batch vs torch dequantization + matmul (also: our
               dequantization + matmul, and the dense bf16 matmul, for scale).
Peers run in turns (bench.measure.Interleaved); each sample is the mean of --iters calls timed with CUDA
events, both replayed from a CUDA graph of --iters calls (`graph`: device time, as the captured decode
step runs them) and launched eagerly (`eager`: the host's launch cost included; Triton's Python launcher
costs tens of microseconds, more than most of these kernels run). `ratios` are torch / ours from the graph
replays (above 1: ours is faster), `ratios_eager` from the eager calls; medians of per-round ratios.

Run:  python -m bench.gpu_kernels [--contexts 1024,4096] [--repeats 7] [--iters 50]   (CUDA)
      python -m bench.gpu_kernels --sweep  (CUDA: graph times over the kernels' tuning knobs)
      python -m bench.gpu_kernels --tiny   (tiny shapes; through Triton's interpreter where no CUDA exists)
The last line is one JSON object.
"""

import argparse
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


BENCH_1B = Shape(hidden=2048, heads=32, kv_heads=4, head_dim=64, inter=5632, batch=32, adapters=16, rank=16,
                 block_size=16)  # fmt: skip
TINY = Shape(
    hidden=64, heads=4, kv_heads=2, head_dim=16, inter=64, batch=2, adapters=2, rank=16, block_size=4
)


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
    from deployments.engine.attention import _gather_blocks
    from deployments.engine.gpu_kernels.paged_attention import paged_decode_attention

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
    from deployments.engine.attention import AttentionMetadata, PrefillSpan, StepChunks, attend
    from deployments.engine.gpu_kernels.paged_attention import paged_decode_attention
    from deployments.engine.gpu_kernels.prefill_attention import paged_prefill_attention

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

    from deployments.engine.gpu_kernels.rotary_cache import rotary_and_cache, rotary_table

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

    from deployments.engine.gpu_kernels.rms_norm import rms_norm

    norm = LlamaRMSNorm(s.hidden, eps=1e-5).to(device=device, dtype=dtype)
    x = torch.randn(s.batch, s.hidden, dtype=dtype, device=device)
    residual = torch.randn_like(x)
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    return {
        "torch": lambda: norm(residual + x),
        "ours": partial(rms_norm, x, norm.weight, 1e-5, residual, out=out, residual_out=residual_out),
    }


def silu_peers(s: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Callable[[], object]]:
    from deployments.engine.gpu_kernels.activation import silu_and_mul

    gate_up = torch.randn(s.batch, 2 * s.inter, dtype=dtype, device=device)
    out = torch.empty(s.batch, s.inter, dtype=dtype, device=device)
    return {
        "torch": lambda: F.silu(gate_up[:, : s.inter]) * gate_up[:, s.inter :],
        "ours": partial(silu_and_mul, gate_up, out),
    }


def lora_peers(
    s: Shape, in_features: int, splits: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> dict[str, Callable[[], object]]:
    from deployments.engine.gpu_kernels.lora_sgmv import lora_expand, lora_shrink
    from deployments.engine.lora_kernels import LoRABatch, select_kernel

    per = s.batch // s.adapters  # decode: the batch spread evenly over the adapters
    segments = [(a, a * per, (a + 1) * per) for a in range(s.adapters)]
    batch = LoRABatch(
        num_lora_tokens=s.batch,
        offsets=torch.tensor([e for _, _, e in segments], dtype=torch.int32, device=device),
        segments=segments,
        segment_table=torch.tensor(segments, dtype=torch.int64),
    )
    members = len(splits)
    x = torch.randn(s.batch, in_features, dtype=dtype, device=device)
    a = torch.randn(s.adapters, in_features, members * s.rank, dtype=dtype, device=device) * 0.02
    b = torch.randn(s.adapters, s.rank, sum(splits), dtype=dtype, device=device) * 0.02
    y = torch.zeros(s.batch, sum(splits), dtype=dtype, device=device)
    # Today: one module per member, each with its own contiguous slot tensors.
    starts = [sum(splits[:p]) for p in range(members)]
    member_a = [a[:, :, p * s.rank : (p + 1) * s.rank].contiguous() for p in range(members)]
    member_b = [b[:, :, c : c + w].contiguous() for c, w in zip(starts, splits, strict=True)]
    member_y = [torch.zeros(s.batch, w, dtype=dtype, device=device) for w in splits]
    _, kernel = select_kernel(dtype, device, {in_features, *splits, s.rank})
    h = torch.empty(s.batch, members * s.rank, dtype=torch.float32, device=device)

    def today() -> None:
        for p in range(members):
            kernel(member_y[p], x, member_a[p], member_b[p], batch)

    def ours() -> None:
        lora_shrink(x, a, batch.offsets, h)
        lora_expand(h, b, batch.offsets, y, splits=splits)

    return {"torch": today, "ours": ours}


def awq_peers(
    s: Shape, dtype: torch.dtype, device: torch.device
) -> dict[str, dict[str, Callable[[], object]]]:
    """The gate projection's weights in AWQ int4: dequantization alone, and the whole linear at the batch."""
    from deployments.engine.gpu_kernels.awq_dequant import awq_dequantize
    from deployments.engine.gpu_kernels.awq_gemm import awq_linear

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


def sweep(s: Shape, dtype: torch.dtype) -> dict[str, dict[str, float]]:
    """Graph-replayed microseconds of each kernel knob setting: what the defaults were chosen from."""
    from deployments.engine.gpu_kernels.awq_gemm import awq_linear
    from deployments.engine.gpu_kernels.prefill_attention import paged_prefill_attention

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
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="CUDA: graph times of the tuning knobs (attention, awq_linear) instead",
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.tiny:
            parser.error("the GPU kernels bench needs CUDA (or --tiny, which runs Triton's CPU interpreter)")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of Triton
    from deployments.engine.gpu_kernels._triton import triton

    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)"}
    if triton is None:
        result.update(
            skipped="Triton is not installed", kernels_us={}, ratios={}, machine=machine(args.dtype)
        )
        print(json.dumps(result))
        return
    if args.sweep and cuda:
        result["sweep"] = sweep(BENCH_1B, getattr(torch, args.dtype))
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
        "lora_qkv": lora_peers(s, s.hidden, (s.heads * s.head_dim, *(2 * [s.kv_heads * s.head_dim])), dtype,
                               device),
        "lora_gate_up": lora_peers(s, s.hidden, (s.inter, s.inter), dtype, device),
        "lora_down": lora_peers(s, s.inter, (s.hidden,), dtype, device),
        **awq_peers(s, dtype, device),
    }  # fmt: skip
    from deployments.engine.gpu_kernels.paged_attention import num_partitions

    result["attention_partitions"] = {
        c: num_partitions(s.batch, s.kv_heads, -(-c // s.block_size) * s.block_size, device) for c in contexts
    }
    kernels: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    ratios_eager: dict[str, float] = {}
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
        print(name, kernels[name], flush=True)
    result.update(
        dtype=str(dtype).removeprefix("torch."), shape=vars(s), contexts=contexts, prompt_lengths=lengths,
        prefill_cached=cached, repeats=repeats,
        iters=iters, kernels_us=kernels, ratios=ratios, ratios_eager=ratios_eager,
        machine=machine(str(dtype).removeprefix("torch.")),
    )  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
