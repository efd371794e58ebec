"""Multi-LoRA delta kernels head to head on the bench model's module shapes (decode: 2 tokens per adapter).

Each "module" has its own slot tensors so weights are not hot in L1/L2 between calls, as in a real step.
Run: python -m bench.lora_kernel [--dtype bfloat16|float32] [--tokens 32] [--adapters 16]
The last line is one JSON object with per-module microseconds and ratios against grouped_mm and the loop.
"""

import argparse
import json
import time

import torch

from deployments.engine.lora_kernels import (
    LoRABatch,
    LoRAKernel,
    _cpu_extension,
    grouped_mm_kernel,
    loop_kernel,
    sgmv_cpu_kernel,
)

SHAPES = {"q/o": (1024, 1024), "k/v": (1024, 256), "gate/up": (1024, 2816), "down": (2816, 1024)}


def batch_for(tokens: int, adapters: int) -> LoRABatch:
    per = tokens // adapters
    segments = [(s, s * per, (s + 1) * per) for s in range(adapters)]
    return LoRABatch(
        num_lora_tokens=tokens,
        offsets=torch.tensor([e for _, _, e in segments], dtype=torch.int32),
        segments=segments,
        segment_table=torch.tensor(segments, dtype=torch.int64),
    )


def time_kernel(
    kernel: LoRAKernel,
    y: torch.Tensor,
    x: torch.Tensor,
    mods: list[tuple[torch.Tensor, torch.Tensor]],
    batch: LoRABatch,
) -> float:
    """Microseconds per module call, cycling through distinct weights."""

    def run() -> None:
        for a, b in mods:
            kernel(y, x, a, b, batch)

    run()
    start = time.perf_counter()
    for _ in range(5):
        run()
    return (time.perf_counter() - start) / (5 * len(mods)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tiny", action="store_true", help="small shapes: checks the bench runs")
    args = parser.parse_args()
    shapes = {label: (i // 16, o // 16) for label, (i, o) in SHAPES.items()} if args.tiny else SHAPES
    if args.tiny:
        args.tokens, args.adapters, args.rank = 8, 2, 8  # grouped_mm wants 16-byte strides
    dtype = getattr(torch, args.dtype)
    batch = batch_for(args.tokens, args.adapters)
    kernels: dict[str, LoRAKernel] = {"loop": loop_kernel, "grouped_mm": grouped_mm_kernel}
    if _cpu_extension() is not None:
        kernels["sgmv_cpu"] = sgmv_cpu_kernel
    result: dict[str, object] = {"dtype": args.dtype, "tokens": args.tokens, "adapters": args.adapters}
    per_shape: dict[str, dict[str, float]] = {}
    for label, (in_f, out_f) in shapes.items():
        x = torch.randn(args.tokens, in_f, dtype=dtype)
        y = torch.zeros(args.tokens, out_f, dtype=dtype)
        linear = torch.nn.Linear(in_f, out_f, bias=False).to(dtype)
        mods = [
            (
                torch.randn(args.adapters, in_f, args.rank, dtype=dtype),
                torch.randn(args.adapters, args.rank, out_f, dtype=dtype),
            )
            for _ in range(24)
        ]
        timings: dict[str, float] = {}
        for name, kernel in kernels.items():
            timings[name] = time_kernel(kernel, y, x, mods, batch)
        with torch.inference_mode():
            linear(x)
            start = time.perf_counter()
            for _ in range(50):
                linear(x)
            timings["base_linear"] = (time.perf_counter() - start) / 50 * 1e6
        per_shape[label] = {k: round(v, 1) for k, v in timings.items()}
        result[label] = per_shape[label]
        print(label, per_shape[label])
    if "sgmv_cpu" in kernels:
        rows = [per_shape[label] for label in shapes]
        result["sgmv_vs_grouped_mm"] = round(
            sum(s["grouped_mm"] for s in rows) / sum(s["sgmv_cpu"] for s in rows), 2
        )
        result["sgmv_vs_loop"] = round(sum(s["loop"] for s in rows) / sum(s["sgmv_cpu"] for s in rows), 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
