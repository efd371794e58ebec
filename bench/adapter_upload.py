"""Upload-to-servable time: how long after an admin starts uploading an adapter the first request using
it succeeds, on a running platform; against the peer a platform without hot-swap needs (restart the engine
with the adapter on disk, then serve the first request). Also adapter activation times on the engine.

The whole HTTP app runs in-process (uvicorn on loopback) over a real engine and SQLite, with the registry
watcher a replica runs; the model is the ~150M bench model with rank-16 all-linear adapters. The two peers
run in turns (upload, restart, restart, upload, ...), one round per upload: the restart serves the adapter
uploaded last, on a fresh engine beside the idle running one. Their ratio is taken per round (median and
spread).
Run: python -m bench.adapter_upload [--uploads 8] [--dtype bfloat16]; the last line is one JSON object.
"""

import argparse
import json
import secrets
import statistics
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path

import httpx

from app.auth.api_keys import generate_key
from app.bootstrap import build_services
from app.main import create_app
from app.served_models.catalog import BaseModelSpec
from app.settings import Settings
from bench.admin_upload import post_adapter
from bench.assets import ensure_bench_assets
from bench.live_server import LiveServer
from bench.measure import Interleaved, machine
from billing import repository
from billing.db import session_scope
from billing.migrate import upgrade
from deployments.engine.async_engine import AsyncEngine
from deployments.engine.config import EngineConfig
from deployments.engine.interface import EngineRequest, LocalEngineClient
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.sampling_params import SamplingParams
from deployments.registry_watcher import RegistryWatcher

MODEL = "bench"


def upload(url: str, admin_key: str, name: str, owner: str, source: Path) -> httpx.Response:
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {admin_key}"}, timeout=120) as admin:
        return post_adapter(admin, name, owner, source)


def first_success(url: str, key: str, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    while True:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"},
                       timeout=120)  # fmt: skip
        if r.status_code == 200:
            return
        time.sleep(0.01)


def restart_to_serve(config: EngineConfig, ref_name: str) -> float:
    """The peer: a fresh engine (what a restart costs) serving one request on the adapter."""
    start = time.perf_counter()
    engine = LLMEngine(config)
    ref = engine.adapters.store.latest(ref_name)
    engine.add_request(EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=1), ref))
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - start
    engine.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--uploads", type=int, default=8, help="rounds: one upload and one restart each")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tiny", action="store_true", help="two uploads on the tiny model: checks it runs")
    args = parser.parse_args()
    if args.tiny:
        args.uploads = 2
        model_dir, _, adapter_dirs = ensure_bench_assets(preset="tiny", num_adapters=1, rank=4)
    else:
        model_dir, _, adapter_dirs = ensure_bench_assets()
    work = Path(tempfile.mkdtemp(prefix="upload-bench-"))
    url = f"sqlite:///{work / 'db.sqlite'}"
    upgrade(url)
    admin_key = secrets.token_urlsafe(32)
    store = work / "adapters"
    settings = Settings.model_validate(
        {"data_dir": work, "database_url": url, "admin_key": admin_key, "adapter_cache_ttl_s": 0.0,
         "adapter_store": store}
    )  # fmt: skip
    config = EngineConfig(
        model=model_dir, served_model_name=MODEL, adapter_store=store, dtype=args.dtype, max_loras=8,
        max_lora_rank=16, kv_cache_memory_mb=512,
    )  # fmt: skip
    engine = AsyncEngine(config)
    services = build_services(settings, LocalEngineClient({MODEL: engine}), {MODEL: BaseModelSpec(model_dir)})
    watcher = RegistryWatcher(engine, MODEL, services.session_factory, interval_s=0.5)
    watcher.start()
    key = generate_key(services.key_secret)
    with session_scope(services.session_factory) as session:  # type: ignore[arg-type]
        # enterprise: no rate limits, so a full run measures the bench's subject, not the free tier's 60 RPM
        tenant = repository.create_tenant(session, name="bench", tier="enterprise")
        repository.create_api_key(session, tenant_id=tenant.id, prefix=key.prefix, key_hash=key.hash)
        tenant_id = tenant.id
    sources = list(adapter_dirs.values())
    upload_only: list[float] = []
    uploaded: list[str] = []  # adapter ids, for the restart peer to serve

    def hot(url: str) -> float:
        """Upload a new adapter version and wait for its first success on the running platform."""
        i = len(uploaded)
        name = f"a{i}-{uuid.uuid4().hex[:6]}"
        start = time.perf_counter()
        response = upload(url, admin_key, name, tenant_id, sources[i % len(sources)])
        assert response.status_code == 201, response.text
        upload_only.append(time.perf_counter() - start)
        first_success(url, key.plaintext, name)
        uploaded.append(response.json()["id"])
        return time.perf_counter() - start

    with LiveServer(create_app(services)) as server:
        first_success(server.url, key.plaintext, MODEL)  # warm
        # Rotation puts the upload first in round 0, so the restart always has an uploaded adapter.
        runs = Interleaved(
            {"hot": partial(hot, server.url), "restart": lambda: restart_to_serve(config, uploaded[-1])},
            repeats=args.uploads,
        ).run()
    manager = engine.adapters
    disk_to_cpu_ms = manager.cpu.load_seconds / max(1, manager.cpu.loads) * 1e3
    cpu_to_slot_ms = manager.activation_seconds / max(1, manager.slots.loads) * 1e3
    watcher.stop()
    engine.shutdown()
    to_servable, ratio = runs.samples["hot"], runs.ratio("restart", "hot")
    size_mb = sum(f.stat().st_size for f in sources[0].iterdir()) / 2**20
    print(f"restart / hot: x{ratio['median']} ({ratio['min']}..{ratio['max']}) over {args.uploads} rounds")
    print(json.dumps({
        "uploads": args.uploads,
        "adapter_mb": round(size_mb, 1),
        "upload_p50_ms": round(statistics.median(upload_only) * 1e3, 1),
        "upload_to_servable_p50_ms": round(statistics.median(to_servable) * 1e3, 1),
        "upload_to_servable_max_ms": round(max(to_servable) * 1e3, 1),
        "restart_to_servable_ms": round(runs.median("restart") * 1e3, 1),
        "ratio_restart_vs_hot": round(ratio["median"], 2),
        "ratio_restart_vs_hot_spread": ratio,
        "activation_disk_to_cpu_ms": round(disk_to_cpu_ms, 2),
        "activation_cpu_to_slot_ms": round(cpu_to_slot_ms, 2),
        "dtype": args.dtype,
        "machine": machine(args.dtype),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
