"""Every benchmark runs: each `bench/` script's `--tiny` mode, as a subprocess, ends with one JSON line.

Timings are never asserted here (they belong to the benches' own output); this only keeps a bench from
breaking unseen when the code it measures changes. `bench.load_test` runs in
tests/e2e/test_load_and_faults.py; `bench.ray_ops`, `bench.assets`, `bench.load_faults` and
`bench.locustfile` are its helpers, not benches.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHES = {
    "sampler": {"rows", "peaked_median_us"},
    "lora_kernel": {"dtype", "tokens"},
    "metering": {"sqlite_ratio", "postgres_ratio"},
    "rate_limiter": set(),
    "limiter_flood": set(),
    "adapter_upload": {"upload_to_servable_p50_ms", "ratio_restart_vs_hot"},
    "multi_lora": set(),
    "gateway": set(),
    "routing": set(),
}


@pytest.mark.slow
@pytest.mark.parametrize("bench", list(BENCHES))
def test_the_bench_runs_in_its_tiny_mode(bench: str) -> None:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", f"bench.{bench}", "--tiny"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    last = result.stdout.strip().splitlines()[-1]
    data = json.loads(last)
    assert isinstance(data, dict) and data, last
    assert BENCHES[bench] <= set(data), f"{bench} printed {sorted(data)}"
