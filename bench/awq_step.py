"""An AWQ base through our int4 linear (deployments/engine/model/awq_base.py) against the same model
in bf16, in one run: correctness of the linear against the dequantized reference, and the decode step,
interleaved.

  correctness: the first layer's gate projection of the AWQ engine, each side (fused GEMM, dequantize +
               matmul) at 1, 16, 32 and 256 rows, against x @ the fp32 dequantized weight (max error
               relative to the largest output; bf16 activations, so ~1e-2 is its precision); with each
               side's time (median of interleaved repeats) to pick awq_fused_max_rows;
  step:        decode steps of a batch of 32 base requests (prefill untimed), bf16 engine vs the AWQ engine
               (default awq_fused_max_rows) vs the AWQ engine fused at every batch, in turns; medians and
               ratios vs bf16.
The AWQ checkpoint is exported here from the random-init preset (app/modelprep/awq_export.py, group 128).

Run:  python -m bench.awq_step [--tiny] [--device cuda] [--preset bench-1b] [--rounds 3]
`--tiny` runs the tiny model on the CPU (the torch fallback without a GPU). The last line is one JSON object.
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from app.modelprep.awq_export import export_awq
from bench.assets import BENCH_DIR, ensure_bench_assets
from bench.measure import machine
from bench.multi_lora import decode_tok_s, make_requests
from deployments.engine.config import EngineConfig
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.model.awq_base import AwqLinear, dequantize_in_torch
from deployments.engine.model.lora_layers import MultiLoRALinear

ALWAYS_FUSED = 1 << 30


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median microseconds of fn over repeats (synchronized on CUDA)."""
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def linear_check(engine: LLMEngine, repeats: int) -> dict[str, Any]:
    module = engine.loaded.model.get_submodule("model.layers.0.mlp.gate_proj")
    base = module.base if isinstance(module, MultiLoRALinear) else module
    assert isinstance(base, AwqLinear), type(base)
    device = base.qweight.device
    weight = dequantize_in_torch(base.qweight, base.qzeros, base.scales.float(), base.group_size)
    saved = base.fused_max_rows
    out: dict[str, Any] = {"uses_triton": base.uses_triton, "shape": [base.in_features, base.out_features]}
    try:
        for rows in (1, 16, 32, 256):
            gen = torch.Generator().manual_seed(rows)
            x = torch.randn(rows, base.in_features, generator=gen).to(
                device=device, dtype=engine.loaded.dtype
            )
            want = x.float() @ weight
            entry: dict[str, Any] = {}
            sides = {"fused": ALWAYS_FUSED, "dequant_matmul": 0}
            with torch.no_grad():
                for side, limit in sides.items():
                    base.fused_max_rows = limit
                    got = base(x).float()
                    entry[f"{side}_rel_err"] = float((got - want).abs().max() / want.abs().max())
                times: dict[str, list[float]] = {side: [] for side in sides}
                for _ in range(3):  # interleaved
                    for side, limit in sides.items():
                        base.fused_max_rows = limit
                        times[side].append(timed(partial(base, x), device, repeats))
            for side, samples in times.items():
                entry[f"{side}_us"] = round(statistics.median(samples), 1)
            entry["ratio_fused_vs_dequant"] = round(entry["fused_us"] / entry["dequant_matmul_us"], 3)
            out[str(rows)] = entry
    finally:
        base.fused_max_rows = saved
    out["ok"] = all(
        e[f"{s}_rel_err"] < 2e-2 for k, e in out.items() if k.isdigit() for s in ("fused", "dequant_matmul")
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the CPU: checks it runs")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--preset", default="bench-1b")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.tiny:
        args.device, args.preset, args.rounds = "cpu", "tiny", 1
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    adapters, rank = (2, 4) if args.tiny else (16, 16)
    model_dir, store_root, _ = ensure_bench_assets(preset=args.preset, num_adapters=adapters, rank=rank)
    group = 32 if args.tiny else 128
    awq_dir = BENCH_DIR / f"{args.preset}-awq-g{group}"
    if not (awq_dir / "config.json").is_file():
        export_awq(model_dir, awq_dir, group_size=group)
    batch, steps = (4, 2) if args.tiny else (32, 16)

    def engine(model: Path, **extra: Any) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=model,
                adapter_store=store_root,
                dtype=dtype,
                device=args.device,
                max_loras=2,
                max_lora_rank=rank,
                max_num_seqs=batch,
                max_num_batched_tokens=2048,
                kv_cache_memory_mb=16 if args.tiny else 1024,
                enable_prefix_caching=False,
                **extra,
            )
        )

    engines = {
        "bf16": engine(model_dir),
        "awq": engine(awq_dir, quantization="awq", awq_kernel="ours"),
        "awq_fused": engine(awq_dir, quantization="awq", awq_kernel="ours", awq_fused_max_rows=ALWAYS_FUSED),
    }
    result: dict[str, Any] = {"preset": args.preset, "dtype": dtype, "batch": batch, "group_size": group}
    result["linear"] = linear_check(engines["awq"], 3 if args.tiny else 50)
    requests = make_requests(batch, num_adapters=1, prompt_range=(64, 64), out_range=(1, 1), seed=3)
    for e in engines.values():  # warm: graphs captured at start, first-step allocations
        decode_tok_s(e, requests, None, 1)
    step_ms: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, e in engines.items():
            step_ms[name].append(batch / decode_tok_s(e, requests, None, steps) * 1e3)
    result["step_ms"] = {name: round(statistics.median(s), 3) for name, s in step_ms.items()}
    result["step_ratio_vs_bf16"] = {
        name: round(result["step_ms"][name] / result["step_ms"]["bf16"], 3) for name in ("awq", "awq_fused")
    }
    result["weights_mib"] = {name: round(e.loaded.weights_bytes / 2**20, 1) for name, e in engines.items()}
    # A capture that fails falls back to eager decode with a log line only: say which engines replayed graphs.
    result["decode_graphs"] = {name: e.runner.graphs is not None for name, e in engines.items()}
    for e in engines.values():
        e.close()
    result["machine"] = machine(dtype)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
