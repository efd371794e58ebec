"""The engine's intra-op threads on a CPU: every core, or every core less one (EngineConfig.cpu_threads),
on an idle machine and beside a busy process.

A served engine shares its machine with its replica's event loop, the ingress, the batch runner and Ray. A
forward whose parallel regions span every core waits at each region's end for the worker that such work
preempted; with a core left to them, it does not. Peers on one engine, interleaved round by round (threads
set between runs): `all_idle`, `less_one_idle`, `all_busy`, `less_one_busy`, where `busy` is a second
process spinning meanwhile (one core's worth of other work). Each sample: `--rows` sequences decoding, the
median of their decode steps and of `--prefills` prefill steps of a `--prompt`-token prompt.
Run:  python -m bench.cpu_threads [--preset demo] [--rounds 5] [--tiny]
The last line is one JSON object: each peer's decode and prefill ms (medians over rounds, spreads) and the
ratios less_one / all, idle and busy.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from bench.assets import ensure_bench_assets
from bench.host_overhead import add_batch, bench_engine
from bench.measure import Interleaved, machine, spread
from deployments.engine.cpu_features import engine_threads
from deployments.engine.llm_engine import LLMEngine


@contextmanager
def busy_process(on: bool) -> Iterator[None]:
    """Another process spinning on one core for the block's length, if `on`."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if on else None
    try:
        if spinner is not None:
            time.sleep(0.2)  # running before the timed steps
        yield
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def decode_ms(engine: LLMEngine, rows: int, prompt: int, steps: int) -> float:
    """Median decode step with `rows` sequences decoding (their prefill untimed)."""
    add_batch(engine, [None] * rows, prompt_len=prompt, tokens=steps + 3)
    while engine.has_unfinished() and engine.counters.last_step_tokens != rows:
        engine.step()
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        if engine.counters.last_step_tokens == rows:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def prefill_ms(engine: LLMEngine, prompt: int, prefills: int) -> float:
    """Median step of one `prompt`-token prompt alone (a fresh prompt each time: no cached prefix)."""
    times = []
    for _ in range(prefills):
        add_batch(engine, [None], prompt_len=prompt, tokens=1)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        while engine.has_unfinished():
            engine.step()
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo", choices=["tiny", "demo", "bench-150m"])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--steps", type=int, default=30, help="decode steps per sample")
    parser.add_argument("--prefills", type=int, default=5, help="prefill steps per sample")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--tiny", action="store_true", help="tiny preset, 2 rounds of a few steps: checks it runs"
    )
    args = parser.parse_args()
    if args.tiny:
        args.preset, args.rows, args.prompt, args.steps, args.prefills, args.rounds = "tiny", 2, 32, 4, 2, 2
    model_dir, store_root, dirs = ensure_bench_assets(preset=args.preset, num_adapters=1, rank=16)
    engine, _ = bench_engine(model_dir, store_root, dirs, device="cpu", batch=max(4, args.rows), adapters=1)
    counts = {"all": torch.get_num_threads(), "less_one": engine_threads(None)}
    prefills: dict[str, list[float]] = {}

    def peer(threads: int, busy: bool, name: str) -> Callable[[], float]:
        def once() -> float:
            torch.set_num_threads(threads)
            with busy_process(busy):
                decode = decode_ms(engine, args.rows, args.prompt, args.steps)
                prefills.setdefault(name, []).append(prefill_ms(engine, args.prompt, args.prefills))
            return decode

        return once

    peers = {
        f"{label}_{state}": peer(threads, state == "busy", f"{label}_{state}")
        for label, threads in counts.items()
        for state in ("idle", "busy")
    }
    runs = Interleaved(peers, repeats=args.rounds).run()

    def ratio(samples: dict[str, list[float]], state: str) -> dict[str, float]:
        pairs = zip(samples[f"less_one_{state}"], samples[f"all_{state}"], strict=True)
        return spread([a / b for a, b in pairs])

    result = {
        "threads": counts,
        "decode_ms": {name: spread(samples) for name, samples in runs.samples.items()},
        "prefill_ms": {name: spread(samples) for name, samples in prefills.items()},
        "decode_ratio_less_one_vs_all": {state: ratio(runs.samples, state) for state in ("idle", "busy")},
        "prefill_ratio_less_one_vs_all": {state: ratio(prefills, state) for state in ("idle", "busy")},
        "rows": args.rows,
        "prompt": args.prompt,
        "preset": args.preset,
        "rounds": args.rounds,
        "machine": machine(engine.config.dtype),
    }
    torch.set_num_threads(counts["all"])
    engine.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
