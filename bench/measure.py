"""Measuring on shared VMs: peers interleaved (A B A B ...), medians with their spread, and the machine;
and a bench run from two checkouts in turns (before/after a change in one call).

A single sequential run on a shared 2-core VM measures the neighbours; running the peers in turns and
taking the median of per-round ratios cancels most of a neighbour's burst, and the spread says how much
is left. Every bench puts `machine()` in its JSON so a figure always says which CPU type gave it.
"""

import json
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from deployments.engine.cpu_features import cpu_features


def machine(dtype: str | None = None) -> dict[str, Any]:
    """CPU model, ISA, cores, torch threads and version, the GPU if any, and the compute dtype if given."""
    cpu = cpu_features()
    info: dict[str, Any] = {
        "cpu": cpu.model,
        "isa": cpu.isa,
        "native_bf16": cpu.native_bf16,
        "cores": cpu.cores,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "arch": platform.machine(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    if dtype is not None:
        info["dtype"] = dtype
    return info


def spread(samples: list[float]) -> dict[str, float]:
    """Median, min and max of samples (max-min over median is the relative spread)."""
    med = statistics.median(samples)
    return {
        "median": round(med, 4),
        "min": round(min(samples), 4),
        "max": round(max(samples), 4),
        "rel_spread": round((max(samples) - min(samples)) / med, 3) if med else 0.0,
    }


class Interleaved:
    """Runs named peers in turns, `repeats` rounds, and summarises each peer and each ratio of peers.

    Each round runs every peer once, in a rotated order so no peer always goes first. Ratios are taken per
    round (the two runs were seconds apart, under the same neighbours) and summarised by their median.
    """

    def __init__(self, peers: Mapping[str, Callable[[], float]], *, repeats: int) -> None:
        self.peers = dict(peers)
        self.repeats = repeats
        self.samples: dict[str, list[float]] = {name: [] for name in self.peers}

    def run(self) -> "Interleaved":
        names = list(self.peers)
        for r in range(self.repeats):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                self.samples[name].append(self.peers[name]())
        return self

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])

    def ratio(self, top: str, bottom: str) -> dict[str, float]:
        """Per-round top/bottom: median and spread."""
        return spread([a / b for a, b in zip(self.samples[top], self.samples[bottom], strict=True)])

    def summary(self) -> dict[str, dict[str, float]]:
        return {name: spread(values) for name, values in self.samples.items()}


def checkouts_in_turns(
    script: Path, args: list[str], checkouts: Mapping[str, str], *, runs: int
) -> dict[str, list[dict[str, Any]]]:
    """Runs `python script args` against each checkout's code, `runs` times each in turns (A B A B ..., the
    order rotated per run), each a child process, and returns each run's JSON (its last line) per checkout.

    Before/after in one call: a checkout is a repository root, e.g. a git worktree of the commit before a
    change. The same script (this harness) drives both; every child runs in this process's directory (so
    they share the bench's cached assets) with its checkout first on sys.path, so the code it measures, and
    the helpers the script imports, are that checkout's."""
    launch = (
        "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); sys.argv[0] = sys.argv.pop(1); "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    names = list(checkouts)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r in range(runs):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            root = str(Path(checkouts[name]).resolve())
            argv = [sys.executable, "-c", launch, root, str(script), *args]
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(
                    f"{script} against {root} failed ({done.returncode}): {done.stderr[-2000:]}"
                )
            results[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return results
