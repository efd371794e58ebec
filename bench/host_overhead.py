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
"""

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
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

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        cuda = engine.device.type == "cuda"

        def timed(owner: Any, name: str, phase: str) -> None:
            inner: Callable[..., Any] = getattr(owner, name)

            def run(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return inner(*args, **kwargs)
                finally:
                    self.totals[phase] += time.perf_counter() - start

            setattr(owner, name, run)

        timed(engine.scheduler, "schedule", "schedule")
        timed(engine.runner, "prepare", "metadata")
        timed(engine.runner, "run", "run")  # includes prepare; forward = run - metadata
        timed(engine.logits, "sample", "sampling")
        self.cuda = cuda

    def step(self) -> float:
        start = time.perf_counter()
        self.engine.step()
        elapsed = time.perf_counter() - start
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
    args = parser.parse_args()
    if args.tiny:
        args.batch, args.adapters, args.steps, args.rounds = 8, 2, 6, 2
    model_dir, store_root, adapter_dirs = ensure_bench_assets(
        preset=args.preset, num_adapters=args.adapters, rank=16
    )
    engine = LLMEngine(
        EngineConfig(
            model=model_dir,
            adapter_store=store_root,
            dtype="float32",
            device=args.device,
            max_loras=args.adapters,
            max_lora_rank=16,
            max_num_seqs=args.batch,
            max_num_batched_tokens=max(512, 16 * args.batch),
            kv_cache_memory_mb=256,
            enable_prefix_caching=False,
        )
    )
    refs = [engine.adapters.store.latest(name) for name in adapter_dirs]
    for ref in refs:
        future = engine.adapters.prefetch(ref)
        if future is not None:
            future.result()
    lora_refs: list[AdapterRef | None] = [refs[i % len(refs)] for i in range(args.batch)]
    base_refs: list[AdapterRef | None] = [None] * args.batch
    clock = PhaseClock(engine)
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
        "machine": machine("float32"),
    }
    engine.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
