"""Adapter-aware routing against Ray Serve's default router, on the same workload in the same run: a real
Serve app (local Ray, HTTP proxy on loopback) with 3 engine replicas of a tiny Llama and 24 public adapters.

Per router, on fresh replicas (the adapters are uploaded before they start, so every load is the router's
doing): a warm-up burst (2 concurrent streamed requests per adapter), then N bursts of one per adapter.
Reported, from the replicas' counters behind GET /admin/routing: adapter loads ((adapter, replica) pairs),
duplicate loads (pairs beyond one replica per adapter), the hit rate after warm-up; and client-side TTFT
(first SSE chunk carrying a choice) over the measured bursts.
Run: python -m bench.routing [--bursts 3] [--max-tokens 8]; the last line is one JSON object.
"""

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from adapters.demo_adapters import DEMO_ADAPTERS, build_from_recipe
from app.modelprep.demo_model import ensure_model
from bench.measure import machine
from bench.routing_counters import routing_delta
from bench.serve_platform import Platform, local_platform

MODEL = "tiny-llama"


async def streamed(client: httpx.AsyncClient, model: str, max_tokens: int) -> float | None:
    """TTFT in ms as the client sees it; None for a failed request (an error status or error event)."""
    body = {
        "model": model,
        "prompt": "select name from users where",
        "max_tokens": max_tokens,
        "stream": True,
    }
    start = time.perf_counter()
    first: float | None = None
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            await reply.aread()
            return None
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return None
            if first is None and event.get("choices"):  # not the usage-only chunk
                first = (time.perf_counter() - start) * 1e3
    return first


async def burst(
    url: str, key: str, names: list[str], per_adapter: int, max_tokens: int
) -> list[float | None]:
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, timeout=300, headers=headers) as client:
        calls = [streamed(client, n, max_tokens) for n in names for _ in range(per_adapter)]
        return await asyncio.gather(*calls)


def measure(
    platform: Platform,
    key: str,
    names: list[str],
    router: str,
    args: argparse.Namespace,
    replicas: set[str] | None = None,
) -> dict[str, Any]:
    """`replicas`: measure on these (already deployed behind `router`) instead of fresh ones."""
    if replicas is None:
        replicas = platform.deploy(router, args.replicas, args.spill_factor)
    start = platform.snapshot(replicas)
    warm_up = asyncio.run(burst(platform.url, key, names, 2, args.max_tokens))
    warm = platform.snapshot(replicas)
    ttft: list[float | None] = []
    for _ in range(args.bursts):
        ttft += asyncio.run(burst(platform.url, key, names, 1, args.max_tokens))
    end = platform.snapshot(replicas)
    after_warm_up, whole = routing_delta(warm, end), routing_delta(start, end)
    requests, hits = after_warm_up.requests, after_warm_up.hits
    # Pinning adapters to homes trades balance for residency: the busiest replica's share shows the cost.
    busiest = max(end[r]["adapter_requests"] - warm[r]["adapter_requests"] for r in end)
    ok = sorted(t for t in ttft if t is not None)
    return {
        "loads": whole.loads,
        "duplicate_loads": whole.loads - len(whole.replicas_per_adapter),
        "hit_rate": round(hits / requests, 4) if requests else None,
        "requests_after_warm_up": requests,  # adapter requests the replicas counted: expect bursts * adapters
        "busiest_replica_requests": busiest,  # of those; an even split is requests / 3
        "p50_ttft_ms": round(statistics.median(ok), 1) if ok else None,
        "p95_ttft_ms": round(ok[min(len(ok) - 1, int(0.95 * len(ok)))], 1) if ok else None,
        "errors": sum(t is None for t in warm_up + ttft),
        "replicas_used": len({r for where in whole.replicas_per_adapter.values() for r in where}),
    }


def setup(platform: Platform, adapter_dir: Path, adapters: int) -> tuple[str, list[str]]:
    """An enterprise tenant (its rate limits never bind here) and public copies of one adapter."""
    files = {
        p: (p, (adapter_dir / p).read_bytes()) for p in ("adapter_config.json", "adapter_model.safetensors")
    }
    with platform.admin() as admin:
        tenant = admin.post("/admin/tenants", json={"name": "routing-bench", "tier": "enterprise"})
        tenant.raise_for_status()
        key = admin.post(f"/admin/tenants/{tenant.json()['id']}/keys", json={})
        key.raise_for_status()
        for i in range(adapters):
            made = admin.post(
                "/admin/adapters",
                data={"name": f"route-{i:02d}", "owner": "public", "base_model": MODEL},
                files={"adapter_config": files["adapter_config.json"],
                       "adapter_model": files["adapter_model.safetensors"]},
            )  # fmt: skip
            made.raise_for_status()
    return key.json()["key"], [f"public/route-{i:02d}" for i in range(adapters)]


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--spill-factor", type=float, default=1.5, help="the deployment default")
    parser.add_argument("--adapters", type=int, default=24, help="public adapters, more than the slots")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="2 replicas, 6 adapters: checks the bench runs")
    args = parser.parse_args()
    if args.tiny:
        args.bursts, args.max_tokens, args.adapters, args.replicas = 1, 1, 6, 2
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the table
    # The e2e tests' setup: tiny Llama (cached, shared with bench.gateway) and its demo-sql adapter.
    model_dir = ensure_model(Path("var/bench/tiny-llama"), arch="llama", preset="tiny").resolve()
    with tempfile.TemporaryDirectory(prefix="routing-bench-") as work:
        adapter_dir = build_from_recipe(DEMO_ADAPTERS[0], model_dir, Path(work) / "demo-sql")
        with local_platform(model_dir, MODEL) as platform:
            # A full run uploads through one replica and measures on fresh ones (no load left from the
            # uploads); the tiny run, which only checks that the bench runs, saves that deploy (~1 min).
            first = platform.deploy("default", args.replicas if args.tiny else 1, args.spill_factor)
            key, names = setup(platform, adapter_dir, args.adapters)
            default = measure(platform, key, names, "default", args, first if args.tiny else None)
            ours = measure(platform, key, names, "adapter_aware", args)
    print(f"{'':24}{'default':>12}{'adapter_aware':>16}")
    for field in default:
        print(f"{field:24}{default[field]!s:>12}{ours[field]!s:>16}")
    result = {
        "bench": "routing", "replicas": args.replicas, "adapters": args.adapters, "bursts": args.bursts,
        "spill_factor": args.spill_factor, "ours": ours, "default": default, "machine": machine(),
        "ratios": {
            "loads_default_over_ours": ratio(default["loads"], ours["loads"]),
            "hit_rate_ours_over_default": ratio(ours["hit_rate"], default["hit_rate"]),
            "p50_ttft_default_over_ours": ratio(default["p50_ttft_ms"], ours["p50_ttft_ms"]),
        },
    }  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
