"""Rate-limiter backends: admission decisions per second and the latency one admit adds, per backend,
against the in-process LimiterState (the floor: the same algorithm with no network hop) in the same run.

Sequential admits give the latency each request pays; 64 concurrent admitters give the throughput.
Run: python -m bench.rate_limiter [--n 3000] [--backends local,ray,redis]; the last line is one JSON object.
--tiny: a few seconds on the local backend only (checks that it runs; its numbers mean little).
"""

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid

import ray

from app.limits import LimiterBackend, Limits
from app.limits.local_backend import LocalLimiter
from app.limits.ray_backend import RayLimiter
from app.limits.redis_backend import RedisLimiter

LIMITS = Limits(rpm=10**9, tpm=10**12, max_concurrent=10**6)  # every decision runs every check


async def latency(backend: LimiterBackend, n: int) -> list[float]:
    tenant = f"bench-{uuid.uuid4().hex[:6]}"
    out = []
    for i in range(n):
        start = time.perf_counter()
        await backend.admit(tenant, f"r{i}", LIMITS, 100)
        out.append((time.perf_counter() - start) * 1e3)
        await backend.release(tenant, f"r{i}", 10)
    return out


async def throughput(backend: LimiterBackend, n: int, concurrency: int = 64) -> float:
    tenant = f"bench-{uuid.uuid4().hex[:6]}"
    per = n // concurrency

    async def worker(w: int) -> None:
        for i in range(per):
            await backend.admit(tenant, f"w{w}-{i}", LIMITS, 100)

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return per * concurrency / (time.perf_counter() - start)


def make_backend(name: str) -> LimiterBackend:
    if name == "local":
        return LocalLimiter()
    if name == "ray":
        return RayLimiter(namespace=f"bench-{uuid.uuid4().hex[:6]}")
    url = os.environ.get("LORAPLEX_BENCH_REDIS", "redis://127.0.0.1:6379/0")
    return RedisLimiter(url, key_prefix=f"loraplex-bench:{uuid.uuid4().hex[:6]}", max_connections=64)


async def measure(n: int, names: list[str]) -> dict[str, object]:
    backends = {name: make_backend(name) for name in names}
    for backend in backends.values():  # warm: actor start, connection pool, script load
        await latency(backend, 20)
    result: dict[str, object] = {"n": n}
    for name, backend in backends.items():
        ms = await latency(backend, n)
        result[f"{name}_p50_ms"] = round(statistics.median(ms), 4)
        result[f"{name}_p95_ms"] = round(statistics.quantiles(ms, n=100)[94], 4)
        result[f"{name}_decisions_per_s"] = round(await throughput(backend, n), 1)
        if isinstance(backend, RedisLimiter):
            await backend.aclose()
    for name in names:
        if name != "local" and "local" in names:
            result[f"{name}_vs_local_p50"] = round(result[f"{name}_p50_ms"] / result["local_p50_ms"], 1)  # type: ignore[operator]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--backends", default="local,ray,redis", help="comma-separated: local, ray, redis")
    parser.add_argument("--tiny", action="store_true", help="200 decisions on the local backend only")
    args = parser.parse_args()
    n, names = (200, ["local"]) if args.tiny else (args.n, args.backends.split(","))
    if "ray" in names:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", include_dashboard=False, num_cpus=2, log_to_driver=False)
    try:
        print(json.dumps({"bench": "rate_limiter", "tiny": args.tiny, **asyncio.run(measure(n, names))}))
    finally:
        if "ray" in names:
            ray.shutdown()


if __name__ == "__main__":
    main()
