"""Ingress overhead: the full HTTP app (auth, validation, chat templating/tokenisation, resolution,
response shaping) over calling the engine deployment's handle directly, on the same requests in the
same run, with an engine that answers at once.

Both paths run in this process against the same Ray Serve handle, so the difference is what the ingress
adds; the Serve HTTP proxy hop (present in any Serve app) is not counted. The headline overhead is the
same pair over an in-process engine stub (no Ray round trip to drown it). The four run in turns, request
by request (in a rotated order, so none is always first); the headline overhead is also taken per
block of consecutive requests (--blocks) and reported with its spread over the blocks.
Run: python -m bench.gateway [--requests 300] [--blocks 5]; the last line is one JSON object.
"""

import argparse
import asyncio
import json
import os
import secrets
import statistics
import tempfile
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import httpx
import ray
from ray import serve

from app.auth.api_keys import generate_key
from app.bootstrap import build_services
from app.main import create_app
from app.modelprep.demo_model import ensure_model
from app.served_models.catalog import BaseModelSpec
from app.settings import Settings
from bench.measure import machine, spread
from billing import repository
from billing.db import make_engine, make_session_factory, session_scope
from billing.migrate import upgrade
from deployments.engine.interface import FinishReason
from deployments.engine.outputs import RequestOutput, RequestUsage
from deployments.engine.request import EngineRequest
from deployments.engine.sampling_params import SamplingParams
from deployments.serve_engine_client import ServeEngineClient


async def instant_outputs(request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
    """One finished output, at once: the engine costs nothing, so what remains is the caller's."""
    usage = RequestUsage(len(request.prompt_ids), 0, 1, 0.0, 0.0, 0.0, 0.0, 0)
    yield RequestOutput(request.request_id, "ok", [1], True, FinishReason.LENGTH, None, usage)


class InstantEngine:
    async def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        async for output in instant_outputs(request):
            yield output


# Applied as a call, not as a class decorator, so that the type checker sees a Deployment (as in
# deployments/builder.py).
instant_engine = serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)(InstantEngine)


class LocalInstantClient:
    """An EngineClient in this process whose engine answers at once."""

    def generate(self, base_model: str, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        return instant_outputs(request)

    async def abort(self, base_model: str, request_id: str, replica: str | None) -> bool:
        return False  # every request finishes at once: nothing is left to stop

    async def ready(self, base_model: str) -> bool:
        return True


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1]


def scratch_settings(prefix: str) -> tuple[Settings, Path]:
    """Settings over a fresh, migrated SQLite database in a new temporary folder, and the tiny model."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    model_dir = ensure_model(Path("var/bench/tiny-llama"), arch="llama", preset="tiny")
    url = f"sqlite:///{work / 'db.sqlite'}"
    upgrade(url)
    return Settings(data_dir=work, database_url=url, admin_key=secrets.token_urlsafe(32)), model_dir


async def measure(requests: int, blocks: int) -> dict[str, Any]:
    settings, model_dir = scratch_settings("gateway-bench-")
    url = settings.database_url
    handle = serve.run(instant_engine.bind(), name="gateway-bench", route_prefix=None)
    client = ServeEngineClient({"bench": handle})
    specs = {"bench": BaseModelSpec(model_dir)}
    services = build_services(settings, client, specs)
    key = generate_key(services.key_secret)
    with session_scope(make_session_factory(make_engine(url))) as session:
        # enterprise: no rate limits, so a full run measures the gateway, not the free tier's 60 RPM
        tenant = repository.create_tenant(session, name="bench", tier="enterprise")
        repository.create_api_key(session, tenant_id=tenant.id, prefix=key.prefix, key_hash=key.hash)
    app = create_app(services)
    body = {"model": "bench", "messages": [{"role": "user", "content": "hello " * 60}], "max_tokens": 16}
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench")
    headers = {"authorization": f"Bearer {key.plaintext}"}
    ids = [1] * 70

    async def via_ingress() -> float:
        start = time.perf_counter()
        response = await http.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        return (time.perf_counter() - start) * 1e3

    async def direct() -> float:
        start = time.perf_counter()
        request = EngineRequest(f"d{time.monotonic_ns()}", ids, SamplingParams(max_tokens=16))
        async for _ in client.generate("bench", request):
            pass
        return (time.perf_counter() - start) * 1e3

    # The same app over an in-process engine stub: no Ray round trip (~5 ms, noisy) to drown the ingress.
    local_services = build_services(settings, LocalInstantClient(), specs)
    local_http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(local_services)), base_url="http://b"
    )

    async def via_local_ingress() -> float:
        start = time.perf_counter()
        response = await local_http.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        return (time.perf_counter() - start) * 1e3

    async def local_direct() -> float:
        start = time.perf_counter()
        async for _ in instant_outputs(EngineRequest("x", ids, SamplingParams(max_tokens=16))):
            pass
        return (time.perf_counter() - start) * 1e3

    paths = {
        "ingress": via_ingress,
        "direct": direct,
        "local": via_local_ingress,
        "local_direct": local_direct,
    }
    for _ in range(20):  # warm: connections, caches, first-call paths
        for path in paths.values():
            await path()
    ms: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    for i in range(requests):  # interleaved, so drift affects all alike
        k = i % len(names)
        for name in names[k:] + names[:k]:
            ms[name].append(await paths[name]())
    await http.aclose()
    await local_http.aclose()
    ingress_ms, direct_ms, local_ms, local_direct_ms = (
        ms["ingress"],
        ms["direct"],
        ms["local"],
        ms["local_direct"],
    )
    result: dict[str, Any] = {
        "requests": requests,
        "ingress_p50_ms": round(statistics.median(ingress_ms), 3),
        "ingress_p95_ms": round(percentile(ingress_ms, 95), 3),
        "direct_p50_ms": round(statistics.median(direct_ms), 3),
        "direct_p95_ms": round(percentile(direct_ms, 95), 3),
    }
    result["serve_overhead_p50_ms"] = round(result["ingress_p50_ms"] - result["direct_p50_ms"], 3)
    result["serve_overhead_p95_ms"] = round(result["ingress_p95_ms"] - result["direct_p95_ms"], 3)
    result["ratio_p50"] = round(result["ingress_p50_ms"] / result["direct_p50_ms"], 2)
    # The headline: the ingress's own work per request, measured without the Ray hop.
    result["overhead_p50_ms"] = round(statistics.median(local_ms) - statistics.median(local_direct_ms), 3)
    result["overhead_p95_ms"] = round(percentile(local_ms, 95) - percentile(local_direct_ms, 95), 3)
    size = max(1, requests // blocks)
    per_block = [
        statistics.median(local_ms[b : b + size]) - statistics.median(local_direct_ms[b : b + size])
        for b in range(0, size * blocks, size)
        if local_ms[b : b + size]
    ]
    result["overhead_p50_ms_spread"] = spread(per_block)  # over blocks of consecutive requests
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--blocks", type=int, default=5, help="blocks of requests for the overhead's spread")
    parser.add_argument(
        "--tiny", action="store_true", help="64 requests: checks the bench runs, past the free tier's burst"
    )
    args = parser.parse_args()
    if args.tiny:
        args.requests, args.blocks = 64, 2  # more calls than a rate-limited tenant gets: as a full run
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", include_dashboard=False, num_cpus=2, log_to_driver=False)
    try:
        result = asyncio.run(measure(args.requests, args.blocks))
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]  # unannotated in Ray
        ray.shutdown()
    result["machine"] = machine()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
