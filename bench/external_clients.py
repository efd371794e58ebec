"""External load tools against the real Serve app, beside our own client at the same load: GuideLLM and
AIPerf, each with its stock OpenAI backend, and bench.http_load's streamed client (bench.serve_platform's).

The platform is the Serve app of bench.http_load (`serve run serve_config.yaml`'s graph on a local Ray
cluster of this process's own, SQLite, one engine replica), serving the demo model; with `--in-process`
(and in `--tiny`, which the suite runs) the same HTTP app on uvicorn over one engine in this process, as
bench.lm_eval_compare serves it (no Ray: what is checked there is that the tools' requests all succeed).
One tenant on the enterprise tier, its limits raised so they never bind. The load is the same for every
client: `--requests` streamed /v1/chat/completions at a fixed concurrency, synthetic prompts of `--prompt-
tokens`, outputs fixed at `--output-tokens` with vLLM's `ignore_eos` (GuideLLM sends it with `stop: null`
and `stream_options.continuous_usage_stats`; AIPerf is given it with `--extra-inputs`). The runs alternate
(ours, GuideLLM, AIPerf, ours, ...) for `--repeats`; per client the medians of output tokens/s, TTFT p50
and errors; the ratios of each tool's throughput to ours; and the CPU seconds each client took (the tools
run as subprocesses: their children's rusage; ours: this process's CPU time during its run, which includes
Ray's driver threads, so it is an upper bound).

The tools pin versions that clash with the dev extras (GuideLLM: click~=8.4, sanic; AIPerf: pandas,
pillow~=12.3, rich~=14.1), so each lives in a virtualenv of its own under var/bench/tools/, made on first
use with pip (torch pinned to the project's, CPU-only); `--tools-dir` points elsewhere. Nothing is
downloaded at run time: tokenizers are the model directory's (HF_HUB_OFFLINE).

Run: python -m bench.external_clients [--tiny] [--concurrency 4] [--requests 32] [--repeats 2]
[--tools guidellm,aiperf]; the last line is one JSON object.
"""

import argparse
import asyncio
import contextlib
import json
import os
import resource
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from app.modelprep.demo_model import ensure_model
from bench.lm_eval_compare import serving
from bench.measure import machine
from bench.serve_platform import Platform, local_platform, percentile, stream

ROOT = Path(__file__).resolve().parents[1]
TOOLS_DIR = ROOT / "var" / "bench" / "tools"
MODEL = "demo-llama"
TORCH = "torch==2.13.0"  # the project's: pip takes the CPU wheel it already has, never a CUDA build
TOOLS = {"guidellm": ["guidellm==0.8.1", TORCH], "aiperf": ["aiperf==0.13.0"]}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "NO_COLOR": "1"}  # fmt: skip
ENGINE: dict[str, Any] = {"dtype": "float32", "max_num_seqs": 16}


def tool_env(**more: str) -> dict[str, str]:
    """This process's environment for a tool, without PYTHONPATH: the tool imports from its own virtualenv
    only, never this repository's packages."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **more}


def tool_venv(tool: str, tools_dir: Path) -> Path:
    """The tool's virtualenv (made and installed once; a finished install leaves a marker)."""
    venv = tools_dir / tool
    marker = venv / ".installed"
    wanted = " ".join(TOOLS[tool])
    if marker.exists() and marker.read_text() == wanted:
        return venv
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=tool_env())
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *TOOLS[tool]], check=True, env=tool_env())
    marker.write_text(wanted)
    return venv


class Load:
    """The load every client runs, and where each writes its results."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, url: str, key: str, work: Path) -> None:
        self.concurrency, self.requests = args.concurrency, args.requests
        self.prompt_tokens, self.output_tokens = args.prompt_tokens, args.output_tokens
        self.model_dir, self.url, self.key, self.work = model_dir, url, key, work


def summary(
    outputs: list[int], ttfts: list[float], errors: int, wall_s: float, cpu_s: float
) -> dict[str, Any]:
    return {
        "requests_ok": len(outputs),
        "errors": errors,
        "output_tokens_per_s": round(sum(outputs) / wall_s, 2) if wall_s > 0 else None,
        "ttft_p50_ms": None if not ttfts else round(statistics.median(ttfts), 1),
        "ttft_p99_ms": None if not ttfts else round(percentile(ttfts, 99) or 0.0, 1),
        "wall_s": round(wall_s, 2),
        "client_cpu_s": round(cpu_s, 2),
    }


# -- our own client -----------------------------------------------------------------------------------------


def prompt_text(model_dir: Path, tokens: int, salt: int) -> str:
    """A prompt of about `tokens` tokens (words of the tokenizer's vocabulary), unique per request."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = [f"w{salt}"] + [f"word{(salt * 31 + i) % 97}" for i in range(tokens * 2)]
    ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"][:tokens]
    return str(tokenizer.decode(ids))


def run_ours(load: Load) -> dict[str, Any]:
    prompts = [prompt_text(load.model_dir, load.prompt_tokens, i) for i in range(load.requests)]

    async def main() -> tuple[list[Any], float]:
        queue = list(enumerate(prompts))
        results: list[Any] = []
        async with httpx.AsyncClient(base_url=load.url, timeout=600) as client:

            async def worker() -> None:
                while queue:
                    _, text = queue.pop(0)
                    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "stop": None,
                            "max_completion_tokens": load.output_tokens, "ignore_eos": True}  # fmt: skip
                    results.append(await stream(client, "/v1/chat/completions", body, load.key))

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(load.concurrency)))
            return results, time.perf_counter() - start

    cpu = time.process_time()
    results, wall = asyncio.run(main())
    cpu = time.process_time() - cpu
    ok = [r for r in results if r.ok and r.usage]
    outputs = [int(r.usage["completion_tokens"]) for r in ok]
    ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    return summary(outputs, ttfts, len(results) - len(ok), wall, cpu)


# -- the tools ----------------------------------------------------------------------------------------------


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_tool(command: list[str], env: dict[str, str], log: Path, timeout_s: float) -> tuple[float, float]:
    """Run a tool to its end; (wall seconds, CPU seconds of it and its children). Its output goes to log."""
    cpu, start = children_cpu(), time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(command, env=tool_env(**OFFLINE, **env), stdout=out,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=timeout_s,
                              check=False)  # fmt: skip
    wall, cpu = time.perf_counter() - start, children_cpu() - cpu
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{command[0]} exited {done.returncode}:\n{tail}")
    return wall, cpu


def run_guidellm(load: Load, venv: Path, run: int) -> dict[str, Any]:
    out = load.work / f"guidellm-{run}"
    out.mkdir()
    backend = {"kind": "openai_http", "target": load.url, "model": MODEL, "api_key": load.key,
               "request_format": "/v1/chat/completions"}  # fmt: skip
    data = f"kind=synthetic_text,prompt_tokens={load.prompt_tokens},output_tokens={load.output_tokens}"
    command = [
        str(venv / "bin" / "guidellm"), "run",
        "--backend", json.dumps(backend),
        "--profile", f"kind=concurrent,streams={load.concurrency}",
        "--constraint", f"kind=max_requests,count={load.requests}",
        "--data", data,
        "--tokenizer", json.dumps({"kind": "huggingface_auto", "model": str(load.model_dir)}),
        "--output", json.dumps({"kind": "json", "path": str(out / "benchmarks.json")}),
        "--disable-console-interactive",
    ]  # fmt: skip
    wall, cpu = run_tool(command, {"GUIDELLM__DEFAULT_RESULTS_DIR": str(out)}, out / "log.txt", 900)
    return guidellm_summary(out / "benchmarks.json", wall, cpu)


def guidellm_summary(path: Path, wall: float, cpu: float) -> dict[str, Any]:
    report = json.loads(path.read_text())
    bench = report["benchmarks"][-1]
    metrics = bench["metrics"]

    def stat(name: str, key: str) -> float | None:
        entry = (metrics.get(name) or {}).get("successful") or {}
        value = entry.get(key)
        return None if value is None else float(value)

    totals = metrics.get("request_totals") or {}  # successful, incomplete, errored, total
    errors = int(totals.get("errored", 0)) + int(totals.get("incomplete", 0))
    return {
        "requests_ok": int(totals.get("successful", 0)),
        "errors": errors,
        "output_tokens_per_s": stat("output_tokens_per_second", "mean"),
        "ttft_p50_ms": stat("time_to_first_token_ms", "median"),
        "ttft_p99_ms": stat_percentile(metrics, "time_to_first_token_ms", "p99"),
        "wall_s": round(wall, 2),
        "client_cpu_s": round(cpu, 2),
    }


def stat_percentile(metrics: dict[str, Any], name: str, key: str) -> float | None:
    successful = (metrics.get(name) or {}).get("successful") or {}
    value = (successful.get("percentiles") or {}).get(key)
    return None if value is None else float(value)


def run_aiperf(load: Load, venv: Path, run: int) -> dict[str, Any]:
    out = load.work / f"aiperf-{run}"
    command = [
        str(venv / "bin" / "aiperf"), "profile",
        "--model", MODEL,
        "--url", load.url,
        "--endpoint-type", "chat",
        "--streaming",
        "--api-key", load.key,
        "--concurrency", str(load.concurrency),
        "--request-count", str(load.requests),
        "--isl", str(load.prompt_tokens), "--isl-stddev", "0",
        "--osl", str(load.output_tokens), "--osl-stddev", "0",
        "--extra-inputs", "ignore_eos:true",
        "--tokenizer", hub_cache_entry(load.model_dir, load.work / "hf-cache"),
        "--artifact-dir", str(out),
        "--ui", "none",
        "--no-gpu-telemetry", "--no-server-metrics",
    ]  # fmt: skip
    out.mkdir()
    wall, cpu = run_tool(command, {"HF_HUB_CACHE": str(load.work / "hf-cache")}, out / "log.txt", 900)
    return aiperf_summary(out, wall, cpu)


def hub_cache_entry(model_dir: Path, cache: Path) -> str:
    """The model directory as the cached snapshot of a made-up hub repo in `cache`; its repo id.

    Offline, AIPerf loads a tokenizer only from the hub cache: a directory's path is looked up there as a
    repo id and refused (HFValidationError). Online it would take the path, but then nothing keeps it off
    the hub. So the cache gets one entry whose snapshot is a link to the directory: offline, and no copy.
    """
    storage = cache / f"models--loraplex--{model_dir.name}"
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "snapshots").mkdir(exist_ok=True)
    snapshot = storage / "snapshots" / "local"
    if not snapshot.is_symlink():
        snapshot.symlink_to(model_dir, target_is_directory=True)
    (storage / "refs" / "main").write_text("local")  # the revision AIPerf asks for, resolved here
    return f"loraplex/{model_dir.name}"


def aiperf_summary(out: Path, wall: float, cpu: float) -> dict[str, Any]:
    found = sorted(out.rglob("profile_export_aiperf.json"))
    if not found:
        raise RuntimeError(f"AIPerf wrote no profile_export_aiperf.json under {out}")
    report = json.loads(found[-1].read_text())

    def stat(name: str, key: str) -> float | None:
        entry = report.get(name) or {}
        value = entry.get(key) if isinstance(entry, dict) else None
        return None if value is None else float(value)

    errors = int(stat("error_request_count", "avg") or 0)
    return {
        "requests_ok": int(stat("request_count", "avg") or 0),
        "errors": errors,
        "output_tokens_per_s": stat("output_token_throughput", "avg"),
        "ttft_p50_ms": stat("time_to_first_token", "p50"),
        "ttft_p99_ms": stat("time_to_first_token", "p99"),
        "wall_s": round(wall, 2),
        "client_cpu_s": round(cpu, 2),
    }


# -- the run ------------------------------------------------------------------------------------------------


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": len(runs)}
    for key in ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "wall_s", "client_cpu_s"):
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = round(statistics.median(values), 2) if values else None
    out["errors"] = sum(int(r["errors"]) for r in runs)
    out["requests_ok"] = sum(int(r["requests_ok"]) for r in runs)
    return out


UNBOUND = {"rpm": 1_000_000, "tpm": 1_000_000_000, "max_concurrent": 1_000}


def deploy(platform: Platform, model_dir: Path) -> str:
    platform.deploy_models([{"name": MODEL, "engine": {"model": str(model_dir), **ENGINE}}])
    return platform.tenant("load", "enterprise", **UNBOUND).key


def tenant_key(url: str, admin_key: str) -> str:
    """An enterprise tenant with unbound limits and its key, through the admin API."""
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {admin_key}"}, timeout=60) as admin:
        made = admin.post("/admin/tenants", json={"name": "load", "tier": "enterprise"})
        made.raise_for_status()
        tenant_id = made.json()["id"]
        admin.patch(f"/admin/tenants/{tenant_id}", json=UNBOUND).raise_for_status()
        key = admin.post(f"/admin/tenants/{tenant_id}/keys", json={})
        key.raise_for_status()
    return str(key.json()["key"])


@contextlib.contextmanager
def platform_url(model_dir: Path, work: Path, in_process: bool) -> Iterator[tuple[str, str]]:
    """(the platform's URL, a tenant's API key), on Serve or in this process."""
    if in_process:
        admin_key = secrets.token_urlsafe(32)
        with serving(model_dir, work, admin_key) as url:
            yield url, tenant_key(url, admin_key)
        return
    with local_platform(model_dir, MODEL) as platform:
        yield platform.url, deploy(platform, model_dir)


def run_all(
    load: Load,
    runners: dict[str, Callable[[Load, int], dict[str, Any]]],
    results: dict[str, list[dict[str, Any]]],
    repeats: int,
) -> None:
    run_ours(load)  # warm-up: the engine's first steps and the prompts' tokenizer, timed for no one
    for repeat in range(repeats):
        for name, runner in runners.items():
            results[name].append(runner(load, repeat))
            print(json.dumps({"client": name, "repeat": repeat, **results[name][-1]}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tiny", action="store_true", help="tiny model, 4 requests of 8+4 tokens, one run each"
    )
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each client, alternating")
    parser.add_argument("--tools", default="guidellm,aiperf", help="comma-separated: guidellm, aiperf")
    parser.add_argument("--tools-dir", type=Path, default=TOOLS_DIR)
    parser.add_argument("--in-process", action="store_true", help="the HTTP app without Ray (see above)")
    args = parser.parse_args()
    preset = "demo"
    if args.tiny:
        args.concurrency, args.requests, args.prompt_tokens, args.output_tokens, args.repeats = 2, 4, 8, 4, 1
        preset, args.in_process = "tiny", True
    tools = [t for t in args.tools.split(",") if t]
    venvs = {tool: tool_venv(tool, args.tools_dir) for tool in tools}
    model_dir = ensure_model(
        ROOT / "var" / "bench" / f"{MODEL}-{preset}", arch="llama", preset=preset
    ).resolve()
    runners: dict[str, Callable[[Load, int], dict[str, Any]]] = {"ours": lambda load, _: run_ours(load)}
    if "guidellm" in venvs:
        runners["guidellm"] = lambda load, i: run_guidellm(load, venvs["guidellm"], i)
    if "aiperf" in venvs:
        runners["aiperf"] = lambda load, i: run_aiperf(load, venvs["aiperf"], i)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "platform").mkdir()
        stack = contextlib.ExitStack()
        with stack:
            url, key = stack.enter_context(platform_url(model_dir, Path(tmp) / "platform", args.in_process))
            load = Load(args, model_dir, url, key, Path(tmp))
            run_all(load, runners, results, args.repeats)
    medians = {name: median_of(runs) for name, runs in results.items()}
    ours = medians["ours"]["output_tokens_per_s"] or 0.0
    ratios = {
        name: round(m["output_tokens_per_s"] / ours, 3) if ours and m["output_tokens_per_s"] else None
        for name, m in medians.items()
        if name != "ours"
    }
    print(json.dumps({
        "machine": machine(),
        "platform": "in-process" if args.in_process else "serve",
        "load": {"concurrency": args.concurrency, "requests": args.requests,
                 "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
                 "repeats": args.repeats, "model": f"{MODEL} ({preset})"},
        "clients": medians,
        "throughput_vs_ours": ratios,
        "errors": sum(m["errors"] for m in medians.values()),
    }))  # fmt: skip


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
