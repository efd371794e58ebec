"""The CPU step table per decoder family: our forward's decode step vs HF's forward vs the Llama shape.

One preset (default `demo`: hidden 256, 4 layers, vocabulary 2048) built per family (llama, qwen3,
gemma3_text, phi3), fp32, batch 32 decoding with 16 rank-16 adapters on all seven linears (2 sequences
each). Each family runs the same decode rounds on two engines over the same weights and adapters: one on
our forward (DecoderForward), one on HF's forward with our paged attention inside (HFForward, built as the
engine builds a family that is not on our forward: the fallback it would get). All peers run interleaved, in
rotated order, `--rounds` times; a peer's figure is the median over rounds of its mean forward time per
steady decode step (ModelRunner.run minus building the step's inputs), and ratios are medians of per-round
ratios. Goals (issue 36): ours <= 1.1x Llama's for Qwen3 and Phi-3, <= 1.25x for Gemma 3, and >= 1.5x
faster than the fallback.

On CUDA (`--device cuda`, bf16 by default; bench.gpu_check runs it at bench-1b's shape) a peer's figure is
the whole decode step instead: the forward is launched asynchronously and its device time lands in the
sampler's one sync. Our forward replays its captured decode graphs there, while HF's forward, which is never
captured, runs eagerly, as a family on the fallback would.

Run:  python -m bench.family_step [--tiny] [--preset demo] [--device cpu|cuda] [--dtype D]
          [--archs llama qwen3 ...] [--rounds N] [--steps N] [--threads N]
The last line is one JSON object.
"""

import argparse
import json
from collections.abc import Callable
from typing import Any, get_args
from unittest.mock import patch

import torch

import deployments.engine.model.model_runner as model_runner
from adapters.ref import AdapterRef
from app.modelprep.demo_model import Arch
from bench.assets import ensure_bench_assets
from bench.host_overhead import PhaseClock, bench_engine, decode_round
from bench.measure import Interleaved, machine, spread
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.model.decoder_forward import DecoderForward, HFForward

# Family -> its goal for ours / Llama's forward step. A family whose demo arch does not exist yet is skipped.
GOALS_VS_LLAMA: dict[str, float] = {"llama": 1.0, "qwen3": 1.1, "gemma3_text": 1.25, "phi3": 1.1}
GOAL_SPEEDUP_VS_HF = 1.5


class FamilyEngine:
    """One family's two engines on the same weights and adapters: one on our forward, one on HF's (built as
    a family off our forward is: no layer ops, so HF's attention path and its step layout)."""

    def __init__(self, arch: Arch, args: argparse.Namespace) -> None:
        model_dir, store_root, adapter_dirs = ensure_bench_assets(
            preset=args.preset, num_adapters=args.adapters, rank=16, arch=arch
        )

        def build() -> tuple[LLMEngine, list[AdapterRef]]:
            return bench_engine(
                model_dir,
                store_root,
                adapter_dirs,
                device=args.device,
                batch=args.batch,
                adapters=args.adapters,
                dtype=args.dtype,
            )

        ours, refs = build()
        with patch.object(model_runner, "layer_ops_for", lambda device: None):
            hf, _ = build()
        ours_forward, hf_forward = ours.runner.forward, hf.runner.forward
        if not isinstance(ours_forward, DecoderForward) or not isinstance(hf_forward, HFForward):
            raise RuntimeError(f"{arch}: forwards {ours_forward.name}, {hf_forward.name}; want decoder, hf")
        self.engines = {"ours": ours, "hf": hf}
        self.clocks = {name: PhaseClock(engine) for name, engine in self.engines.items()}
        self.refs: list[AdapterRef | None] = [refs[i % len(refs)] for i in range(args.batch)]
        self.steps = args.steps
        self.step_ms: dict[str, list[float]] = {"ours": [], "hf": []}

    def peer(self, forward: str) -> Callable[[], float]:
        engine = self.engines[forward]

        def run() -> float:
            means = decode_round(engine, self.clocks[forward], self.refs, self.steps)
            self.step_ms[forward].append(means["step"])
            return means["step"] if engine.device.type == "cuda" else means["forward"]

        return run

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny preset, batch 8, 2 adapters, 2 rounds")
    parser.add_argument("--preset", default="demo", help="one shape (and vocabulary) for every family")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, help="default: float32 on the CPU, bfloat16 on CUDA")
    parser.add_argument("--archs", nargs="*", default=None, help="default: every family with a goal")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads; 0: torch's default. On a crowded VM use 1: "
        "intra-op threads spin-waiting on busy cores made a 32x256 GEMM 20x slower than on one",
    )  # fmt: skip
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        args.preset, args.batch, args.adapters, args.steps, args.rounds = "tiny", 8, 2, 4, 2
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    wanted = args.archs or list(GOALS_VS_LLAMA)
    archs = [arch for arch in GOALS_VS_LLAMA if arch in get_args(Arch) and arch in wanted]
    if "llama" not in archs:
        raise SystemExit("--archs needs llama: every family's step is compared with its shape")
    engines = {arch: FamilyEngine(arch, args) for arch in archs}  # type: ignore[arg-type]  # checked above
    peers = {f"{arch}:{fwd}": fam.peer(fwd) for arch, fam in engines.items() for fwd in ("ours", "hf")}
    for run in peers.values():  # warm-up: first shapes, adapter slots
        run()
    for fam in engines.values():
        fam.step_ms = {"ours": [], "hf": []}
    rounds = Interleaved(peers, repeats=args.rounds).run()

    families: dict[str, Any] = {}
    for arch in archs:
        ours_vs_llama = rounds.ratio(f"{arch}:ours", "llama:ours")
        hf_vs_ours = rounds.ratio(f"{arch}:hf", f"{arch}:ours")
        families[arch] = {
            "forward_ms": {fwd: spread(rounds.samples[f"{arch}:{fwd}"]) for fwd in ("ours", "hf")},
            "step_ms": {fwd: spread(ms) for fwd, ms in engines[arch].step_ms.items()},
            "ours_vs_llama": ours_vs_llama,
            "speedup_vs_hf": hf_vs_ours,
            "goal_vs_llama": GOALS_VS_LLAMA[arch],
            "meets_goals": ours_vs_llama["median"] <= GOALS_VS_LLAMA[arch]
            and hf_vs_ours["median"] >= GOAL_SPEEDUP_VS_HF,
        }
    for fam in engines.values():
        fam.close()
    result = {
        "preset": args.preset,
        "device": args.device,
        "dtype": args.dtype,
        "timed": "step" if args.device == "cuda" else "forward",
        "batch": args.batch,
        "adapters": args.adapters,
        "rank": 16,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "families": families,
        "ratios": {
            arch: {
                "ours_vs_llama": f["ours_vs_llama"]["median"],
                "speedup_vs_hf": f["speedup_vs_hf"]["median"],
            }
            for arch, f in families.items()
        },
        "goal_speedup_vs_hf": GOAL_SPEEDUP_VS_HF,
        "skipped": [arch for arch in GOALS_VS_LLAMA if arch not in archs],
        "machine": machine(args.dtype),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
