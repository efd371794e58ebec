"""Host cost of a decode step, measured where compute is nearly nil: no GPU needed to drive it down.

The tiny preset (hidden 64, 2 layers) at batch 32, 16 rank-16 adapters (2 sequences each) against the same
batch on the base model, in turns: a step's time there is almost all host work. Each steady decode step
(all 32 sequences decoding) is split into
  schedule  - Scheduler.schedule (admission, block allocation, slot sort),
  metadata  - ModelRunner.prepare (the step's tensors, one copy),
  forward   - the forward's dispatch (ModelRunner.run minus prepare; a graph replay on CUDA),
  sampling  - LogitsProcessor.sample (biases, masks, the sampler, the one host sync),
  outputs   - the rest of LLMEngine.step (appending tokens, detokenizing, finishing, usage),
and one profiled step counts the torch ops it dispatches. `--preset narrow-22` is bench-1b's 22 layers at
hidden 64: per-layer dispatch is what dominates a GPU step, and this shows it without one.

Run:  python -m bench.host_overhead [--tiny] [--preset tiny|narrow-22] [--device cpu|cuda] [--rounds N]
The last line is one JSON object; the phases are medians over rounds of per-step means, in ms.
`--vs DIR --runs N`: this checkout's engine and DIR's (a repository root, e.g. `git worktree add DIR <commit>`
before a change) each run this script N times in turns, as child processes with the other flags; the JSON
then has each side's phases (medians over its runs) and this/ref ratios taken run pair by run pair.
`--clock thread` times this thread's CPU: on a shared VM a neighbour's time slices then do not count.
"""

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from adapters.ref import AdapterRef
from bench.assets import ensure_bench_assets
from bench.measure import Interleaved, machine, spread
from deployments.engine.config import EngineConfig
from deployments.engine.interface import EngineRequest
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.sampling_params import SamplingParams

PHASES = ("schedule", "metadata", "forward", "sampling", "outputs")


class PhaseClock:
    """Wraps the engine's phase methods on this instance and adds their wall time per step."""

    def __init__(self, engine: LLMEngine, now: Callable[[], float] = time.perf_counter) -> None:
        self.engine = engine
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        cuda = engine.device.type == "cuda"

        def timed(owner: Any, name: str, phase: str) -> None:
            inner: Callable[..., Any] = getattr(owner, name)

            def run(*args: Any, **kwargs: Any) -> Any:
                start = now()
                try:
                    return inner(*args, **kwargs)
                finally:
                    self.totals[phase] += now() - start

            setattr(owner, name, run)

        timed(engine.scheduler, "schedule", "schedule")
        timed(engine.runner, "prepare", "metadata")
        timed(engine.runner, "run", "run")  # includes prepare; forward = run - metadata
        timed(engine.logits, "sample", "sampling")
        self.cuda = cuda
        self.now = now

    def step(self) -> float:
        start = self.now()
        self.engine.step()
        elapsed = self.now() - start
        self.totals["step"] += elapsed
        self.steps += 1
        return elapsed

    def reset(self) -> None:
        self.totals.clear()
        self.steps = 0

    def means_ms(self) -> dict[str, float]:
        t = {k: v / max(1, self.steps) * 1e3 for k, v in self.totals.items()}
        out = {
            "schedule": t.get("schedule", 0.0),
            "metadata": t.get("metadata", 0.0),
            "forward": t.get("run", 0.0) - t.get("metadata", 0.0),
            "sampling": t.get("sampling", 0.0),
        }
        out["outputs"] = t.get("step", 0.0) - sum(out.values())
        out["step"] = t.get("step", 0.0)
        return out


def add_batch(engine: LLMEngine, refs: list[AdapterRef | None], prompt_len: int, tokens: int) -> None:
    tag = time.monotonic_ns()
    for i, ref in enumerate(refs):
        prompt = [5 + (i * 7 + j) % 1000 for j in range(prompt_len)]
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        engine.add_request(EngineRequest(f"{tag}-{i}", prompt, params, ref))


def decode_round(
    engine: LLMEngine, clock: PhaseClock, refs: list[AdapterRef | None], steps: int
) -> dict[str, float]:
    """Per-step phase means over `steps` decode steps with the whole batch decoding (prefill untimed)."""
    add_batch(engine, refs, prompt_len=16, tokens=steps + 2)
    engine.step()  # the prefill: every prompt fits one step's token budget
    while engine.has_unfinished() and engine.counters.last_step_tokens != len(refs):
        engine.step()  # until the whole batch decodes
    clock.reset()
    while engine.has_unfinished():
        clock.step()
        if engine.counters.last_step_tokens != len(refs):  # the last step finishes everyone: not steady
            break
    means = clock.means_ms()  # before draining: those steps are not timed
    while engine.has_unfinished():
        engine.step()
    return means


def ops_per_step(engine: LLMEngine, refs: list[AdapterRef | None]) -> int:
    """torch ops dispatched by one steady decode step (profiler events at the op level)."""
    from torch.profiler import ProfilerActivity, profile

    add_batch(engine, refs, prompt_len=16, tokens=6)
    for _ in range(3):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    while engine.has_unfinished():
        engine.step()
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def bench_engine(
    model_dir: Path,
    store_root: Path,
    adapter_names: Iterable[str],
    *,
    device: str,
    batch: int,
    adapters: int,
    dtype: str = "float32",
) -> tuple[LLMEngine, list[AdapterRef]]:
    """An engine (fp32 unless told) for `batch` decoding sequences with a slot per rank-16 adapter, and the
    adapters' refs, each already in CPU memory (loads finishing mid-round would be timed)."""
    engine = LLMEngine(
        EngineConfig(
            model=model_dir,
            adapter_store=store_root,
            dtype=dtype,
            device=device,
            max_loras=adapters,
            max_lora_rank=16,
            max_num_seqs=batch,
            max_num_batched_tokens=max(512, 16 * batch),
            kv_cache_memory_mb=256,
            enable_prefix_caching=False,
        )
    )
    refs = [engine.adapters.store.latest(name) for name in adapter_names]
    for ref in refs:
        future = engine.adapters.prefetch(ref)
        if future is not None:
            future.result()
    return engine, refs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="batch 8, 2 adapters, 2 rounds: checks it runs")
    parser.add_argument("--preset", default="tiny", choices=["tiny", "narrow-22"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "thread"],
        help="thread: this thread's CPU time, so a busy neighbour's time slices do not count; the host "
        "phases run on this thread alone (forward is then its share of the forward)",
    )
    parser.add_argument("--vs", metavar="DIR", help="compare with the checkout at DIR (see above)")
    parser.add_argument("--runs", type=int, default=5, help="with --vs: runs of each checkout, in turns")
    args, passed = parser.parse_known_args()
    if args.vs:
        print(json.dumps(versus(args.vs, args.runs, _without_vs(sys.argv[1:]))))
        return
    if passed:
        parser.error(f"unrecognized arguments: {' '.join(passed)}")
    if args.tiny:
        args.batch, args.adapters, args.steps, args.rounds = 8, 2, 6, 2
    model_dir, store_root, adapter_dirs = ensure_bench_assets(
        preset=args.preset, num_adapters=args.adapters, rank=16
    )
    engine, refs = bench_engine(
        model_dir, store_root, adapter_dirs, device=args.device, batch=args.batch, adapters=args.adapters
    )
    lora_refs: list[AdapterRef | None] = [refs[i % len(refs)] for i in range(args.batch)]
    base_refs: list[AdapterRef | None] = [None] * args.batch
    clock = PhaseClock(engine, time.thread_time if args.clock == "thread" else time.perf_counter)
    phases: dict[str, list[dict[str, float]]] = {"base": [], "lora": []}

    def peer(name: str, batch_refs: list[AdapterRef | None]) -> Callable[[], float]:
        def run() -> float:
            means = decode_round(engine, clock, batch_refs, args.steps)
            phases[name].append(means)
            return means["step"]

        return run

    peers = {"base": peer("base", base_refs), "lora": peer("lora", lora_refs)}
    for run in peers.values():  # warm-up: first shapes, adapter slots
        run()
    phases = {"base": [], "lora": []}
    rounds = Interleaved(peers, repeats=args.rounds).run()
    result: dict[str, Any] = {
        "preset": args.preset,
        "batch": args.batch,
        "adapters": args.adapters,
        "device": str(engine.device),
        "forward": getattr(getattr(engine.runner, "forward", None), "name", "hf"),
        "decode": "cuda_graphs" if getattr(engine.runner, "graphs", None) else "eager",
        "step_ms": {name: spread(values) for name, values in rounds.samples.items()},
        "lora_vs_base": rounds.ratio("lora", "base"),
        "phases_ms": {
            name: {p: round(statistics.median(m[p] for m in ms), 4) for p in (*PHASES, "step")}
            for name, ms in phases.items()
        },
        "torch_ops_per_step": {
            "base": ops_per_step(engine, base_refs),
            "lora": ops_per_step(engine, lora_refs),
        },
        "clock": args.clock,
        "machine": machine("float32"),
    }
    engine.close()
    print(json.dumps(result))


def _without_vs(argv: list[str]) -> list[str]:
    """The flags for the child runs: these minus --vs and --runs (and their values)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--vs", "--runs"):
            skip = True
        elif not arg.startswith(("--vs=", "--runs=")):
            out.append(arg)
    return out


def versus(ref: str, runs: int, child_args: list[str]) -> dict[str, Any]:
    """This checkout against `ref`, `runs` runs each in turns: each side's phases (medians over its runs) and
    per-pair ratios of the outside-forward part (outputs) and the whole step."""
    from bench.measure import checkouts_in_turns  # here: a ref checkout's bench.measure may not have it

    checkouts = {"this": str(Path.cwd()), "ref": ref}
    results = checkouts_in_turns(Path(__file__).resolve(), child_args, checkouts, runs=runs)
    peers = ("base", "lora")

    def phases(side: str) -> dict[str, dict[str, float]]:
        return {
            peer: {
                p: round(statistics.median(r["phases_ms"][peer][p] for r in results[side]), 4)
                for p in (*PHASES, "step")
            }
            for peer in peers
        }

    def ratios(phase: str) -> dict[str, dict[str, float]]:
        pairs = list(zip(results["this"], results["ref"], strict=True))
        return {
            peer: spread([a["phases_ms"][peer][phase] / b["phases_ms"][peer][phase] for a, b in pairs])
            for peer in peers
        }

    return {
        "checkouts": {"this": str(Path.cwd()), "ref": str(Path(ref).resolve())},
        "runs": runs,
        "args": child_args,
        "phases_ms": {side: phases(side) for side in ("this", "ref")},
        "outputs_this_vs_ref": ratios("outputs"),
        "step_this_vs_ref": ratios("step"),
        "machine": results["this"][0]["machine"],
    }


if __name__ == "__main__":
    main()
