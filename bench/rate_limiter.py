"""Rate-limiter backends: admission decisions per second and the latency one admit adds, per backend,
against the in-process LimiterState (the floor: the same algorithm with no network hop) in the same run.

Sequential admits give the latency each request pays; 64 concurrent admitters give the throughput. The
backends run in turns (A B C, B C A, ...), --repeats rounds of --n decisions each; a backend's p50 is the
median over rounds of each round's p50, its ratio to local is taken per round (median and spread).
Run: python -m bench.rate_limiter [--n 1000] [--repeats 5] [--backends local,ray,redis]; the last line is
one JSON object.
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
from bench.measure import machine, spread

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


async def measure(n: int, names: list[str], repeats: int) -> dict[str, object]:
    backends = {name: make_backend(name) for name in names}
    for backend in backends.values():  # warm: actor start, connection pool, script load
        await latency(backend, 20)
    p50: dict[str, list[float]] = {name: [] for name in names}
    every_ms: dict[str, list[float]] = {name: [] for name in names}
    rates: dict[str, list[float]] = {name: [] for name in names}
    # Interleaved by hand: the peers are coroutines, bench.measure.Interleaved calls plain functions.
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            ms = await latency(backends[name], n)
            every_ms[name] += ms
            p50[name].append(statistics.median(ms))
            rates[name].append(await throughput(backends[name], n))
    for backend in backends.values():
        if isinstance(backend, RedisLimiter):
            await backend.aclose()
    result: dict[str, object] = {"n": n, "repeats": repeats}
    for name in names:
        result[f"{name}_p50_ms"] = round(statistics.median(p50[name]), 4)
        result[f"{name}_p95_ms"] = round(statistics.quantiles(every_ms[name], n=100)[94], 4)  # all rounds
        result[f"{name}_decisions_per_s"] = round(statistics.median(rates[name]), 1)
        result[f"{name}_decisions_per_s_spread"] = spread(rates[name])
    for name in names:
        if name != "local" and "local" in names:  # local is the floor: the same algorithm, no hop
            ratio = spread([a / b for a, b in zip(p50[name], p50["local"], strict=True)])
            result[f"{name}_vs_local_p50"] = round(ratio["median"], 1)
            result[f"{name}_vs_local_p50_spread"] = ratio
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=1000, help="decisions per backend per round")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of every backend")
    parser.add_argument("--backends", default="local,ray,redis", help="comma-separated: local, ray, redis")
    parser.add_argument("--tiny", action="store_true", help="2 rounds of 100 decisions, local backend only")
    args = parser.parse_args()
    n, repeats, names = (100, 2, ["local"]) if args.tiny else (args.n, args.repeats, args.backends.split(","))
    if "ray" in names:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", include_dashboard=False, num_cpus=2, log_to_driver=False)
    try:
        result = asyncio.run(measure(n, names, repeats))
    finally:
        if "ray" in names:
            ray.shutdown()
    print(json.dumps({"bench": "rate_limiter", "tiny": args.tiny, **result, "machine": machine()}))


if __name__ == "__main__":
    main()
