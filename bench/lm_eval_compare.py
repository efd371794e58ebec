"""An external client's proof: EleutherAI's lm-eval harness scores a log-likelihood task through our
OpenAI-compatible /v1/completions for an adapter model, and its own `hf` model (transformers + PEFT, the
same adapter directory) scores the same task; every (document, choice) log-likelihood must agree.

The platform runs in-process (the HTTP app on uvicorn over a real engine and SQLite, with the registry
watcher a replica runs; no Ray). A tenant is created and the adapter uploaded through the admin API, as an
operator does; lm-eval runs as a subprocess (`python -m lm_eval run`) with the tenant's key:
`--model local-completions` (token-id prompts, tokenized locally with the model dir's tokenizer) and, at the
same time, `--model hf --model_args pretrained=<model dir>,peft=<adapter dir>,dtype=float32`. The task is
bench/lm_eval_task/ (a local JSONL); nothing is downloaded (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE).

Run: python -m bench.lm_eval_compare [--limit 20] [--tolerance 1e-4] [--batch-size 1] [--adapter demo-pirate];
the last line is one JSON object; exits 1 if a log-likelihood differs by more than the tolerance.
"""

import argparse
import contextlib
import json
import math
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import httpx

from app.bootstrap import build_services
from app.demo_assets import shipped_demo
from app.main import create_app
from app.modelprep.demo_skills import SKILLS
from app.modelprep.demo_training import ADAPTERS_DIR, BASE_DIR
from app.served_models.catalog import BaseModelSpec
from app.settings import Settings
from bench.live_server import LiveServer
from bench.measure import machine
from billing.migrate import upgrade
from deployments.engine.async_engine import AsyncEngine
from deployments.engine.config import EngineConfig
from deployments.engine.interface import LocalEngineClient
from deployments.registry_watcher import RegistryWatcher

ROOT = Path(__file__).resolve().parents[1]
TASK_DIR = ROOT / "bench" / "lm_eval_task"
TASK = "loraplex_mc"  # bench/lm_eval_task/loraplex_mc.yaml; 20 documents of 4 choices
MODEL = "demo-llama"  # what `loraplex up` serves: the trained demo, fp32
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_EVALUATE_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip

Scores = dict[tuple[int, int], tuple[float, bool]]  # (doc id, choice) -> (log-likelihood, is greedy)


def ensure_assets(adapter: str) -> tuple[Path, Path]:
    """(model dir, PEFT adapter dir) of the trained demo shipped in app/demo_assets (what `loraplex up`
    serves), so that the accuracies mean something; the comparison itself holds for any weights."""
    demo = shipped_demo()
    return demo / BASE_DIR, demo / ADAPTERS_DIR / adapter


@contextlib.contextmanager
def serving(model_dir: Path, work: Path, admin_key: str) -> Iterator[str]:
    """The platform's HTTP app on a loopback port over one fp32 CPU engine; yields its URL."""
    url = f"sqlite:///{work / 'loraplex.db'}"
    upgrade(url)
    store = work / "adapters"
    settings = Settings.model_validate(
        {"data_dir": work, "database_url": url, "admin_key": admin_key, "adapter_cache_ttl_s": 0.0,
         "adapter_store": store}
    )  # fmt: skip
    engine = AsyncEngine(
        EngineConfig(
            model=model_dir, served_model_name=MODEL, adapter_store=store, dtype="float32", device="cpu"
        )
    )
    services = build_services(settings, LocalEngineClient({MODEL: engine}), {MODEL: BaseModelSpec(model_dir)})
    watcher = RegistryWatcher(engine, MODEL, services.session_factory, interval_s=0.2)
    watcher.start()
    try:
        with LiveServer(create_app(services)) as server:
            yield server.url
    finally:
        watcher.stop()
        engine.shutdown()


def tenant_with_adapter(url: str, admin_key: str, adapter_dir: Path, name: str) -> str:
    """As an operator does: an unlimited tenant, its key, and the adapter uploaded as its own; returns the key
    once the adapter answers."""
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {admin_key}"}, timeout=120) as admin:
        tenant = admin.post("/admin/tenants", json={"name": "lm-eval", "tier": "enterprise"})
        tenant.raise_for_status()
        tenant_id = tenant.json()["id"]
        key = admin.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "lm-eval"})
        key.raise_for_status()
        with (adapter_dir / "adapter_model.safetensors").open("rb") as weights:
            uploaded = admin.post(
                "/admin/adapters",
                data={"name": name, "owner": tenant_id},
                files={
                    "adapter_config": (
                        "adapter_config.json",
                        (adapter_dir / "adapter_config.json").read_bytes(),
                    ),
                    "adapter_model": ("adapter_model.safetensors", weights),
                },
            )
        assert uploaded.status_code == 201, uploaded.text
    api_key: str = key.json()["key"]
    body = {"model": name, "prompt": "hi", "max_tokens": 1}
    deadline = time.monotonic() + 60
    while True:  # servable within a second or so (the registry watcher)
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"authorization": f"Bearer {api_key}"},
                       timeout=120)  # fmt: skip
        if r.status_code == 200:
            return api_key
        if time.monotonic() > deadline:
            raise RuntimeError(f"adapter {name!r} not servable: {r.status_code} {r.text}")
        time.sleep(0.1)


def lm_eval(model: str, model_args: dict[str, object], out: Path, limit: int, *extra: str) -> list[str]:
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    return [
        sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", args, "--tasks", TASK,
        "--include_path", str(TASK_DIR.relative_to(ROOT)), "--limit", str(limit), "--log_samples",
        "--output_path", str(out), "--seed", "0", *extra,
    ]  # fmt: skip


def read_samples(out: Path) -> tuple[Scores, float]:
    """Every (doc, choice) log-likelihood of the run's sample log, and its accuracy."""
    [path] = out.rglob(f"samples_{TASK}_*.jsonl")
    scores: Scores = {}
    correct = []
    for line in path.read_text().splitlines():
        sample = json.loads(line)
        for choice, (ll, greedy) in enumerate(sample["filtered_resps"]):
            scores[sample["doc_id"], choice] = (float(ll), greedy in (True, "True"))
        correct.append(float(sample["acc"]))
    return scores, sum(correct) / len(correct)


def run_both(args: argparse.Namespace, work: Path) -> tuple[Scores, Scores, dict[str, float]]:
    """lm-eval through the platform and lm-eval's hf+PEFT reference, at the same time; (ours, reference,
    {"acc_ours", "acc_hf", "local_completions_s", "hf_s"})."""
    model_dir, adapter_dir = ensure_assets(args.adapter)
    env = {**os.environ, **OFFLINE, "HF_DATASETS_CACHE": str(work / "datasets")}
    name = args.adapter  # the tenant's own adapter, named plainly
    admin_key = secrets.token_urlsafe(32)
    with serving(model_dir, work, admin_key) as url:
        api_key = tenant_with_adapter(url, admin_key, adapter_dir, name)
        server_args = {
            "model": name, "base_url": f"{url}/v1/completions", "tokenizer_backend": "huggingface",
            "tokenizer": model_dir, "num_concurrent": 1, "max_retries": 1,
        }  # fmt: skip
        hf_args = {"pretrained": model_dir, "peft": adapter_dir, "dtype": "float32"}
        start = time.perf_counter()
        # Both at once: the reference needs no server, and each run is mostly lm-eval's own start-up. Their
        # output goes to files: a full pipe would stall the one not being read.
        with (work / "hf.log").open("w") as hf_log, (work / "server.log").open("w") as server_log:
            hf = subprocess.Popen(
                lm_eval("hf", hf_args, work / "hf", args.limit, "--device", "cpu"),
                cwd=ROOT, env=env, stdout=hf_log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            batch = ("--batch_size", str(args.batch_size))
            server = subprocess.run(
                lm_eval("local-completions", server_args, work / "server", args.limit, *batch),
                cwd=ROOT, env={**env, "OPENAI_API_KEY": api_key}, stdout=server_log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            server_s = time.perf_counter() - start
            hf.wait()
            hf_s = time.perf_counter() - start
    for label, code, log in (("local-completions", server.returncode, "server"), ("hf", hf.returncode, "hf")):
        if code != 0:
            print((work / f"{log}.log").read_text()[-6000:], file=sys.stderr)
            raise SystemExit(f"lm_eval --model {label} failed ({code}); its output is above")
    ours, acc_ours = read_samples(work / "server")
    ref, acc_hf = read_samples(work / "hf")
    return ours, ref, {"acc_ours": acc_ours, "acc_hf": acc_hf, "local_completions_s": server_s, "hf_s": hf_s}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--limit", type=int, default=20, help="documents of the task scored (at most 20)")
    # fp32 sums of ~10 token log-probabilities (|ll| ~ 10-70): measured differences are ~1e-5 at most.
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest allowed |Δ log-likelihood|")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts per /v1/completions request")
    parser.add_argument("--adapter", default="demo-pirate", choices=[s.name for s in SKILLS])
    parser.add_argument("--tiny", action="store_true", help="4 documents: checks it runs")
    args = parser.parse_args()
    if args.tiny:
        args.limit = 4
    with tempfile.TemporaryDirectory(prefix="lm-eval-bench-") as tmp:
        ours, ref, run = run_both(args, Path(tmp))
    if ours.keys() != ref.keys():
        raise SystemExit(f"the runs scored different requests: {sorted(ours)} vs {sorted(ref)}")
    diffs = {k: abs(ours[k][0] - ref[k][0]) for k in ref}
    worst = max(diffs, key=lambda k: diffs[k])
    print(f"{'doc':>4} {'choice':>6} {'ours':>14} {'hf+peft':>14} {'|diff|':>10}")
    for doc, choice in sorted(ref):
        print(f"{doc:>4} {choice:>6} {ours[doc, choice][0]:>14.6f} {ref[doc, choice][0]:>14.6f} "
              f"{diffs[doc, choice]:>10.2e}")  # fmt: skip
    max_diff = diffs[worst]
    ok = math.isfinite(max_diff) and max_diff <= args.tolerance
    print(json.dumps({
        "docs": len({doc for doc, _ in ref}),
        "loglikelihoods": len(ref),
        "max_abs_diff": max_diff,
        "mean_abs_diff": sum(diffs.values()) / len(diffs),
        "worst": {"doc": worst[0], "choice": worst[1], "ours": ours[worst][0], "hf": ref[worst][0]},
        "tolerance": args.tolerance,
        "ok": ok,
        "greedy_mismatches": sum(ours[k][1] != ref[k][1] for k in ref),
        "acc": {"ours": run["acc_ours"], "hf": run["acc_hf"]},
        "adapter": args.adapter,
        "batch_size": args.batch_size,
        "dtype": "float32",
        "seconds": {"local_completions": round(run["local_completions_s"], 1), "hf": round(run["hf_s"], 1)},
        "lm_eval": version("lm_eval"),
        "torch": version("torch"),
        "machine": machine("float32"),
    }))  # fmt: skip
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
