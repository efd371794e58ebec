"""Rate-limiter backends: admission decisions per second and the latency one admit adds, per backend,
against the in-process LimiterState (the floor: the same algorithm with no network hop) in the same run.

Sequential admits give the latency each request pays; 64 concurrent admitters give the throughput.
Run: python -m bench.rate_limiter [--n 3000]; the last line is one JSON object.
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
        await backend.admit(tenant, f"r{i}", LIMITS, 100, queued=False)
        out.append((time.perf_counter() - start) * 1e3)
        await backend.release(tenant, f"r{i}", 10)
    return out


async def throughput(backend: LimiterBackend, n: int, concurrency: int = 64) -> float:
    tenant = f"bench-{uuid.uuid4().hex[:6]}"
    per = n // concurrency

    async def worker(w: int) -> None:
        for i in range(per):
            await backend.admit(tenant, f"w{w}-{i}", LIMITS, 100, queued=False)

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return per * concurrency / (time.perf_counter() - start)


async def measure(n: int) -> dict[str, object]:
    backends: dict[str, LimiterBackend] = {
        "local": LocalLimiter(),
        "ray": RayLimiter(namespace=f"bench-{uuid.uuid4().hex[:6]}"),
        "redis": RedisLimiter(os.environ.get("LORAPLEX_BENCH_REDIS", "redis://127.0.0.1:6379/0"),
                              key_prefix=f"loraplex-bench:{uuid.uuid4().hex[:6]}", max_connections=64),
    }  # fmt: skip
    for backend in backends.values():  # warm: actor start, connection pool, script load
        await latency(backend, 20)
    result: dict[str, object] = {"n": n}
    for name, backend in backends.items():
        ms = await latency(backend, n)
        result[f"{name}_p50_ms"] = round(statistics.median(ms), 4)
        result[f"{name}_p95_ms"] = round(statistics.quantiles(ms, n=100)[94], 4)
        result[f"{name}_decisions_per_s"] = round(await throughput(backend, n), 1)
    for name in ("ray", "redis"):
        result[f"{name}_vs_local_p50"] = round(result[f"{name}_p50_ms"] / result["local_p50_ms"], 1)  # type: ignore[operator]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=3000)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", include_dashboard=False, num_cpus=2, log_to_driver=False)
    try:
        print(json.dumps(asyncio.run(measure(args.n))))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
