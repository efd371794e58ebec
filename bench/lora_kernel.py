"""Multi-LoRA delta kernels head to head on the bench model's module shapes (decode: 2 tokens per adapter).

Each "module" has its own slot tensors so weights are not hot in L1/L2 between calls, as in a real step.
The kernels (and the base layer's own linear, for scale) run in turns, --repeats rounds, each round every
shape; a ratio is taken per round (summed over the shapes) and reported as its median and spread.
Run: python -m bench.lora_kernel [--dtype bfloat16|float32] [--tokens 32] [--adapters 16] [--repeats 7]
The last line is one JSON object with per-module microseconds (medians over rounds) and ratios against
grouped_mm and the loop.
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from bench.measure import Interleaved, machine
from deployments.engine.model.lora_kernels import (
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


PASSES = 2  # over the 24 modules per timing


def time_kernel(
    kernel: LoRAKernel,
    y: torch.Tensor,
    x: torch.Tensor,
    mods: list[tuple[torch.Tensor, torch.Tensor]],
    batch: LoRABatch,
) -> float:
    """Microseconds per module call, cycling through distinct weights."""
    start = time.perf_counter()
    for _ in range(PASSES):
        for a, b in mods:
            kernel(y, x, a, b, batch)
    return (time.perf_counter() - start) / (PASSES * len(mods)) * 1e6


def time_linear(linear: torch.nn.Linear, x: torch.Tensor) -> float:
    with torch.inference_mode():
        start = time.perf_counter()
        for _ in range(50):
            linear(x)
        return (time.perf_counter() - start) / 50 * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7, help="rounds of every kernel on every shape")
    parser.add_argument("--tiny", action="store_true", help="small shapes, 2 rounds: checks the bench runs")
    args = parser.parse_args()
    shapes = {label: (i // 16, o // 16) for label, (i, o) in SHAPES.items()} if args.tiny else SHAPES
    if args.tiny:
        args.tokens, args.adapters, args.rank, args.repeats = 8, 2, 8, 2  # grouped_mm wants 16-byte strides
    dtype = getattr(torch, args.dtype)
    batch = batch_for(args.tokens, args.adapters)
    kernels: dict[str, LoRAKernel] = {"loop": loop_kernel, "grouped_mm": grouped_mm_kernel}
    if _cpu_extension() is not None:
        kernels["sgmv_cpu"] = sgmv_cpu_kernel
    # Per shape and peer, a callable timing it once (us per module call).
    timers: dict[str, dict[str, Callable[[], float]]] = {}
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
        timers[label] = {
            name: partial(time_kernel, kernel, y, x, mods, batch) for name, kernel in kernels.items()
        }
        timers[label]["base_linear"] = partial(time_linear, linear, x)
        for timer in timers[label].values():  # warm: first-call paths, oneDNN primitives
            timer()
    per_shape: dict[str, dict[str, list[float]]] = {label: {} for label in shapes}

    def every_shape(name: str) -> float:
        """One round of one peer: every shape once; the sum of its per-module times."""
        total = 0.0
        for label in shapes:
            us = timers[label][name]()
            per_shape[label].setdefault(name, []).append(us)
            total += us
        return total

    peers = [*kernels, "base_linear"]
    runs = Interleaved({name: partial(every_shape, name) for name in peers}, repeats=args.repeats).run()
    result: dict[str, object] = {
        "dtype": args.dtype, "tokens": args.tokens, "adapters": args.adapters, "repeats": args.repeats,
    }  # fmt: skip
    for label in shapes:
        result[label] = {name: round(statistics.median(us), 1) for name, us in per_shape[label].items()}
        print(label, result[label])
    result["summed_us"] = runs.summary()
    # For scale: the delta's cost against the base layer's own GEMM that it rides on.
    result["grouped_mm_vs_base"] = runs.ratio("grouped_mm", "base_linear")
    if "sgmv_cpu" in kernels:
        # The headline: how much faster our kernel is than each peer, per round (summed over shapes).
        vs_grouped, vs_loop = runs.ratio("grouped_mm", "sgmv_cpu"), runs.ratio("loop", "sgmv_cpu")
        result["sgmv_vs_grouped_mm"] = round(vs_grouped["median"], 2)
        result["sgmv_vs_grouped_mm_spread"] = vs_grouped
        result["sgmv_vs_loop"], result["sgmv_vs_loop_spread"] = round(vs_loop["median"], 2), vs_loop
        print(f"sgmv_cpu vs grouped_mm x{vs_grouped['median']} ({vs_grouped['min']}..{vs_grouped['max']}), "
              f"vs loop x{vs_loop['median']} ({vs_loop['min']}..{vs_loop['max']})")  # fmt: skip
    result["machine"] = machine(args.dtype)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
