"""Writing an adapter into its device pages, on an idle process and beside a busy Python thread.

Each torch op releases the GIL; taking it back waits for the switch interval (5 ms by default) while another
thread of the process runs Python, as the app's event loop does in process and a Serve replica's loop does
beside its engine thread. So what a load costs inside busy steps is set by its number of ops, not their work.
Peers, on the same engine's wrapped modules and the same adapters, interleaved round by round:
  per_module  the load as the engine did it before (per module: zero the run, copy each page of A and B;
              written here as the reference),
  one_call    the engine's `load_adapter_into_slot`: one `_foreach_copy_` over every module's pages, from
              page-shaped sources its adapter tiers prepared when they read the adapter,
each `idle` and `busy` (a thread spinning in Python meanwhile). A sample is the median of `--loads` loads.
Run:  python -m bench.slot_load [--preset demo] [--rounds 5] [--loads 60] [--tiny]
The last line is one JSON object: each peer's ms (median over rounds, spread) and one_call / per_module.
"""

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from adapters.weights import AdapterWeights
from bench.assets import ensure_bench_assets
from bench.host_overhead import bench_engine
from bench.measure import Interleaved, machine, spread
from deployments.engine.model.lora_layers import MultiLoRALinear, load_adapter_into_slot

Load = Callable[[dict[str, MultiLoRALinear], int, int, AdapterWeights], None]


@torch.no_grad()
def per_module(modules: dict[str, MultiLoRALinear], slot: int, pages: int, weights: AdapterWeights) -> None:
    """The reference: four small ops per module and page, as the engine loaded adapters before."""
    for path, module in modules.items():
        run = slice(slot, slot + pages)
        module.lora_a[run].zero_()
        module.lora_b[run].zero_()
        w = weights.modules.get(path)
        if w is None:
            continue
        for page, first in enumerate(range(0, w.rank, module.page_rank)):
            last = min(w.rank, first + module.page_rank)
            module.lora_a[slot + page, :, : last - first].copy_(w.a[first:last].t())
            module.lora_b[slot + page, : last - first, :].copy_(w.b[:, first:last].t())


@contextmanager
def busy_thread(on: bool) -> Iterator[None]:
    """A thread running Python for the block's length (a stand-in for an event loop's work), if `on`."""
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            for _ in range(1000):
                n += 1

    thread = threading.Thread(target=spin, daemon=True)
    if on:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if on:
            thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo", choices=["tiny", "demo", "bench-150m"])
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loads", type=int, default=60, help="loads per sample (their median is the sample)")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny preset, 2 rounds of 6 loads: checks it runs"
    )
    args = parser.parse_args()
    if args.tiny:
        args.preset, args.adapters, args.rounds, args.loads = "tiny", 2, 2, 6
    model_dir, store_root, dirs = ensure_bench_assets(preset=args.preset, num_adapters=args.adapters, rank=16)
    engine, refs = bench_engine(model_dir, store_root, dirs, device="cpu", batch=4, adapters=args.adapters)
    manager = engine.adapters
    modules = manager._modules
    adapters = [w for w in (manager.cpu.get(ref) for ref in refs) if w is not None]
    pages = max(manager.pages_for(ref) for ref in refs)

    def peer(load: Load, busy: bool) -> Callable[[], float]:
        def once() -> float:
            times = []
            with busy_thread(busy):
                for i in range(args.loads):
                    start = time.perf_counter()
                    load(modules, (i % args.adapters) * pages, pages, adapters[i % len(adapters)])
                    times.append(time.perf_counter() - start)
                    time.sleep(0.001)  # a step's other work between loads: the GIL changes hands
            return 1e3 * statistics.median(times)

        return once

    runs = Interleaved(
        {
            f"{name}_{state}": peer(load, state == "busy")
            for name, load in (("per_module", per_module), ("one_call", load_adapter_into_slot))
            for state in ("idle", "busy")
        },
        repeats=args.rounds,
    ).run()
    result = {
        "ms": {name: spread(samples) for name, samples in runs.samples.items()},
        "ratio_one_call_vs_per_module": {
            state: runs.ratio(f"one_call_{state}", f"per_module_{state}") for state in ("idle", "busy")
        },
        "modules": len(modules),
        "pages": pages,
        "page_rank": next(iter(modules.values())).page_rank,
        "preset": args.preset,
        "rounds": args.rounds,
        "loads": args.loads,
        "switch_interval_ms": 1e3 * sys.getswitchinterval(),
        "machine": machine(engine.config.dtype),
    }
    engine.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
