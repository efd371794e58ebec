"""The CPU step table per decoder family: our forward's decode step vs HF's forward vs the Llama shape.

One preset (default `demo`: hidden 256, 4 layers, vocabulary 2048) built per family (llama, qwen3,
gemma3_text; phi3 once its demo arch exists), fp32, batch 32 decoding with 16 rank-16 adapters on all seven
linears (2 sequences each). Each family's engine runs the same decode rounds twice per round: on our forward
(DecoderForward) and on HF's forward with our paged attention inside (HFForward, the fallback a family not
on our forward gets), swapped in on the same engine, weights and adapters. All peers run interleaved, in
rotated order, `--rounds` times; a peer's figure is the median over rounds of its mean forward time per
steady decode step (ModelRunner.run minus building the step's inputs), and ratios are medians of per-round
ratios. Goals (issue 36): ours <= 1.1x Llama's for Qwen3 and Phi-3, <= 1.25x for Gemma 3, and >= 1.5x
faster than the fallback.

Run:  python -m bench.family_step [--tiny] [--preset demo] [--rounds N] [--steps N] [--threads N]
The last line is one JSON object.
"""

import argparse
import json
from collections.abc import Callable
from typing import Any, get_args

import torch

from adapters.ref import AdapterRef
from app.modelprep.demo_model import Arch
from bench.assets import ensure_bench_assets
from bench.host_overhead import PhaseClock, bench_engine, decode_round
from bench.measure import Interleaved, machine, spread
from deployments.engine.model.decoder_forward import DecoderForward, HFForward

# Family -> its goal for ours / Llama's forward step. A family whose demo arch does not exist yet is skipped.
GOALS_VS_LLAMA: dict[str, float] = {"llama": 1.0, "qwen3": 1.1, "gemma3_text": 1.25, "phi3": 1.1}
GOAL_SPEEDUP_VS_HF = 1.5


class FamilyEngine:
    """One family's engine with its adapters loaded, and both forwards to swap between."""

    def __init__(self, arch: Arch, args: argparse.Namespace) -> None:
        model_dir, store_root, adapter_dirs = ensure_bench_assets(
            preset=args.preset, num_adapters=args.adapters, rank=16, arch=arch
        )
        self.engine, refs = bench_engine(
            model_dir, store_root, adapter_dirs, device="cpu", batch=args.batch, adapters=args.adapters
        )
        ours = self.engine.runner.forward
        if not isinstance(ours, DecoderForward):
            raise RuntimeError(f"{arch} runs HF's forward, not ours: nothing to compare")
        self.forwards: dict[str, DecoderForward | HFForward] = {
            "ours": ours,
            "hf": HFForward(self.engine.loaded.model),
        }
        self.refs: list[AdapterRef | None] = [refs[i % len(refs)] for i in range(args.batch)]
        self.clock = PhaseClock(self.engine)
        self.steps = args.steps
        self.step_ms: dict[str, list[float]] = {"ours": [], "hf": []}

    def peer(self, forward: str) -> Callable[[], float]:
        def run() -> float:
            self.engine.runner.forward = self.forwards[forward]
            means = decode_round(self.engine, self.clock, self.refs, self.steps)
            self.step_ms[forward].append(means["step"])
            return means["forward"]

        return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny preset, batch 8, 2 adapters, 2 rounds")
    parser.add_argument("--preset", default="demo", help="one shape (and vocabulary) for every family")
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
    archs = [arch for arch in GOALS_VS_LLAMA if arch in get_args(Arch)]
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
        fam.engine.close()
    result = {
        "preset": args.preset,
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
        "machine": machine("float32"),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
