"""Every benchmark runs: each `bench/` script's `--tiny` mode, as a subprocess, ends with one JSON line.

Timings are never asserted here (they belong to the benches' own output); this only keeps a bench from
breaking unseen when the code it measures changes, and checks that its JSON names the machine it ran on.
`bench.load_test` has a `--tiny` mode too, but even that starts Ray and `serve run` for minutes:
tests/e2e/test_load_and_faults.py runs it whole, with every fault, so here only its options are checked.
A new script in bench/ must be listed below.
"""

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import POSTGRES_ADMIN_URL

ROOT = Path(__file__).resolve().parents[1]
# bench -> keys its JSON line must have. rate_limiter and limiter_flood belong to the limiter's redesign:
# only that they run and print JSON is checked here.
BENCHES = {
    "sampler": {"rows", "peaked_median_us"},
    "lora_kernel": {"dtype", "tokens"},
    # Through Triton's CPU interpreter in --tiny; where Triton is not installed it prints `skipped`.
    "gpu_kernels": {"device", "ratios", "kernels_us"},
    "metering": {"sqlite_ratio", "postgres_ratio"},
    "rate_limiter": set(),
    "limiter_flood": set(),
    "adapter_upload": {"upload_to_servable_p50_ms", "ratio_restart_vs_hot"},
    "multi_lora": {"ours_tok_s", "peft_tok_s", "ratio_vs_peft", "ratio_continuous_vs_static"},
    "gateway": {"requests", "overhead_p50_ms", "serve_overhead_p50_ms"},
    # Issue 33: the ingress against another revision, both trees serving at once, in turns.
    "gateway_vs": {"rev_commit", "chat", "asgi", "ratio_vs_rev"},
    "continuations": {"truncation_auto_ms", "messages_templated", "flood_refused_ms"},
    "routing": {"ours", "default", "ratios"},
    "fairness": {"fair_ratio_p90_vs_alone", "throughput_ratio_fair_vs_fifo", "weighted_shares"},
    "grammar_libraries": {"xgrammar", "llguidance", "chosen"},
    "adapter_store": {
        "upload_ms",
        "cold_ms",
        "hit_fresh_ms",
        "hit_ms",
        "local_ms",
        "ratio_cold_vs_hit_fresh",
    },
    "structured": {
        "throughput_ratio",
        "compile_p50_ms",
        "compile_p99_ms",
        "mask_us_per_token",
        "closing_us_per_token",
        "stall_neighbour_ratio",
        "email_host_us_per_token",
    },
    "parsing": {"openings", "ratio_regex_vs_one_pass", "stream_s", "prompt_ids", "ratio_union_vs_validate"},
    "lm_eval_compare": {"docs", "max_abs_diff", "tolerance", "ok"},
    "adapter_skills": {"scores", "min_api", "max_base", "max_api_peft_gap"},
    "http_load": {"engine", "platform", "overhead", "metering", "errors", "capacity_rps", "rate_rps"},
    "prefix_reuse": {
        "followup_ttft_ms",
        "cold_ttft_ms",
        "ratio_followup_vs_cold",
        "ratio_default_vs_cold",
        "cached_tokens_exact",
    },
    "host_overhead": {"step_ms", "lora_vs_base", "phases_ms", "torch_ops_per_step"},
    "slot_load": {"ms", "ratio_one_call_vs_per_module", "modules", "pages"},
    "cpu_threads": {"threads", "decode_ms", "prefill_ms", "decode_ratio_less_one_vs_all"},
    "family_step": {"families", "ratios", "goal_speedup_vs_hf"},
    "gpu_check": {"env", "correctness", "host", "families"},
    "awq_step": {"linear", "step_ms", "step_ratio_vs_bf16"},
    # Issue 29: overshoot must be 0 on every backend and utilisation near 1; asserted in the bench's test.
    "budget_race": {"local", "redis", "naive", "admission"},
    # Issue 37: the Batch API against the same requests sent interactively, and TTFT beside a batch.
    "batch": {"throughput_ratio_batch_vs_interactive", "batch_req_s", "interactive_req_s", "beside_batch"},
    "batch_claims": {"lines", "claim_ms", "insert_s"},
    "multi_tenant": {
        "throughput_vs_resident",
        "ttft_p99_vs_resident",
        "max_wait_s",
        "loads",
        "adapters",
        "slots",
        "lora_page_rank",
        "max_rank_slots_ttft_p99_vs_resident",
        "no_read_wait_ttft_p99_vs_ours",
    },
}
RUN_ELSEWHERE = {
    "load_test": "tests/e2e/test_load_and_faults.py",
    # makes the load tools' virtualenvs on a fresh machine first: longer than this file's limit
    "external_clients": "tests/test_external_clients.py",
}
HELPERS = {
    "__init__",
    "assets",
    "locustfile",
    "ray_ops",
    "measure",
    "workload",
    "serve_platform",
    "admin_upload",
    "routing_counters",
    "live_server",
    "stripe_stub",
}  # pieces of benches, not benches


def present(bench: str) -> bool:
    return (ROOT / "bench" / f"{bench}.py").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("bench", [b for b in BENCHES if present(b)])
def test_the_bench_runs_in_its_tiny_mode(bench: str, request: pytest.FixtureRequest) -> None:
    env = _user_env()
    triton = importlib.util.find_spec("triton")
    if bench == "gpu_kernels" and triton is not None and triton.origin is not None:
        # Triton may be importable here from outside the environment (an extra PYTHONPATH entry): keep it.
        env["PYTHONPATH"] += os.pathsep + str(Path(triton.origin).parents[1])
    if bench == "metering":  # measures PostgreSQL too: the suite's server, skipped (or failed in CI) as there
        request.getfixturevalue("postgres_admin")
        env["LORAPLEX_BENCH_POSTGRES"] = POSTGRES_ADMIN_URL
    data = _tiny_run(bench, env)
    if bench == "batch":  # the engine's own queue time of every streamed request, found by its id
        engine_side = data["beside_batch"]["engine_side"]
        assert all(engine_side[kind]["ttft_ms_max"] > 0 for kind in ("alone", "beside")), engine_side
        assert data["beside_batch"]["step_ms_ratio"] > 0, data  # in process: the engine's whole steps


@pytest.mark.slow
def test_the_batch_bench_runs_through_serve_in_its_tiny_mode() -> None:
    """bench.batch's Serve mode: the runner in an ingress replica of `serve run`'s app graph."""
    data = _tiny_run("batch", _user_env(), "--serve")
    assert data["mode"] == "serve" and data["beside_batch"]["batch_lines_done_meanwhile"], data
    assert data["beside_batch"]["step_ms_ratio"] is None, data  # a replica's engine is not in this process


def _user_env() -> dict[str, str]:
    """As a user runs a bench: none of this session's LORAPLEX_* settings (the e2e app's) leak into it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env.update(RAY_AUTH_MODE="disabled", PYTHONPATH=str(ROOT))
    return env


def _tiny_run(bench: str, env: dict[str, str], *extra: str) -> dict[str, Any]:
    """The bench's JSON line, from `python -m bench.<bench> --tiny [extra]`."""
    result = subprocess.run(
        [sys.executable, "-m", f"bench.{bench}", "--tiny", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=480,  # Serve benches: ~3 min when busy
    )  # fmt: skip
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    # The JSON line is the bench's last; Ray's own log lines (a raylet's, on the driver's stdout) may follow.
    objects = [line for line in result.stdout.strip().splitlines() if line.startswith("{")]
    assert objects, f"no JSON line:\n{result.stdout[-2000:]}"
    last = objects[-1]
    data = json.loads(last)
    assert isinstance(data, dict) and data, last
    assert BENCHES[bench] <= set(data), f"{bench} printed {sorted(data)}"
    # Every figure says which machine gave it (bench.measure.machine()).
    assert isinstance(data.get("machine"), dict), f"{bench} printed no machine: {sorted(data)}"
    assert {"cpu", "isa", "threads"} <= set(data["machine"]), f"{bench} machine: {data['machine']}"
    return data


def test_every_script_in_bench_is_run_or_named_a_helper() -> None:
    scripts = {path.stem for path in (ROOT / "bench").glob("*.py")}
    assert scripts - HELPERS == {b for b in BENCHES if present(b)} | set(RUN_ELSEWHERE)


@pytest.mark.parametrize("bench", sorted(set(BENCHES) | set(RUN_ELSEWHERE)))
def test_every_bench_has_a_tiny_mode(bench: str) -> None:
    if not present(bench):
        pytest.skip(f"bench/{bench}.py is not there")
    source = ast.parse((ROOT / "bench" / f"{bench}.py").read_text())
    options = {
        node.args[0].value
        for node in ast.walk(source)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }
    assert "--tiny" in options


def test_the_load_tests_tiny_mode_is_the_least_load_its_checks_accept() -> None:
    from bench.load_test import parse

    options = parse(["--tiny"])
    assert (options.duration, options.users, options.faults) == (20.0, 4, [])


async def test_the_load_tests_lease_count_reads_the_limiter_actor_as_it_is() -> None:
    """The load test's no-leaked-leases check reads the actor's state directly: when the limiter's state
    moved inside a WaitingState, that read failed and the check failed on every run."""
    from app.limits.protocol import Limits
    from app.limits.ray_backend import LimiterActor
    from bench.ray_ops import lease_counter

    actor = LimiterActor.__ray_actor_class__(4)  # type: ignore[attr-defined]  # the class under @ray.remote
    limits = Limits(max_concurrent=2)
    assert (await actor.admit("tenant", "held", limits, 10, 0)).admitted
    assert (await actor.admit("tenant", "done", limits, 10, 0)).admitted
    await actor.release("tenant", "done", 5)
    assert lease_counter()(actor) == {"tenant": {"leases": 1, "queued": 0, "ids": ["held"]}}
