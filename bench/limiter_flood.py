"""One tenant floods the rate limiter; does another tenant notice? (issue 14)

Per backend (local, ray, redis), through the real admission path (`Admission.acquire`, as one ingress
replica runs it): tenant B sends ordinary requests one after another, first alone (quiet phase), then while
tenant A floods FLOOD over-limit requests on an `on_limit: queue` tier whose only concurrency slot is held
(flood phase: WAVES bursts of FLOOD / WAVES requests at once, spread over B's phase). Prints B's admission
latency p50/p99 in both phases, how often B was told the limiter is unavailable (a 503), what became of
A's requests, the CPU, and last one JSON line.

Passes (exit 0) when B sees no unavailable answer and its flood-phase p99 stays under 50 ms; --tiny (a few
seconds, a small flood, the local backend unless --backend says otherwise) only checks that it runs.

Run: python -m bench.limiter_flood [--backend local|ray|redis|all] [--flood 1000] [--tiny]
Redis: LORAPLEX_BENCH_REDIS (default redis://127.0.0.1:6379/0), under a key prefix of its own.
"""

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from app.admission import Admission
from app.limits import LimiterBackend, LimiterUnavailable, Limits

P99_BUDGET_MS = 50.0
FLOODER = Limits(max_concurrent=1, on_limit="queue", max_queue_ms=2_000)  # over its limit throughout
ORDINARY = Limits(rpm=1_000_000, tpm=10**9, max_concurrent=10_000)  # every check runs, none binds
WAVES = 10  # A's flood comes in this many bursts, so that B meets one all through its phase
REDIS_URL = os.environ.get("LORAPLEX_BENCH_REDIS", "redis://127.0.0.1:6379/0")


@dataclass(frozen=True)
class Sizes:
    flood: int  # A's requests, all at once
    quiet: int  # B's requests per phase
    pace_s: float  # B's pause between requests


def cpu() -> dict[str, str | int | list[str] | None]:
    """The CPU model and the vector ISA it offers (from /proc/cpuinfo on Linux)."""
    model, flags = platform.processor() or platform.machine(), set[str]()
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    isa: list[str] = [name for name in ("avx2", "avx512f", "amx_tile") if name in flags]
    return {"cpu": model, "cores": os.cpu_count(), "isa": isa}


async def acquire(backend: LimiterBackend, tenant: str, limits: Limits) -> Admission:
    return await Admission.acquire(
        backend, tenant=tenant, tier="bench", request_id=f"r-{uuid.uuid4().hex}", limits=limits,
        reserve=100, fail_open=False,
    )  # fmt: skip


async def ordinary(backend: LimiterBackend, tenant: str, sizes: Sizes) -> tuple[list[float], int]:
    """B's requests, one at a time: admission latency (ms) of each admitted one, and the unavailable count."""
    latencies, unavailable = [], 0
    for _ in range(sizes.quiet):
        start = time.perf_counter()
        try:
            admission = await acquire(backend, tenant, ORDINARY)
        except LimiterUnavailable:
            unavailable += 1
        else:
            latencies.append((time.perf_counter() - start) * 1e3)
            await admission.release(10)
        await asyncio.sleep(sizes.pace_s)
    return latencies, unavailable


async def flood(backend: LimiterBackend, tenant: str, sizes: Sizes) -> Counter[str]:
    """A's requests in WAVES bursts spread over B's phase, each burst all at once; what became of them."""
    per_wave, pause = sizes.flood // WAVES, sizes.quiet * sizes.pace_s / WAVES
    waves = []
    for _ in range(WAVES):
        burst = (acquire(backend, tenant, FLOODER) for _ in range(per_wave))
        waves.append(asyncio.gather(*burst, return_exceptions=True))
        await asyncio.sleep(pause)
    outcomes = [outcome for wave in await asyncio.gather(*waves) for outcome in wave]
    return Counter(type(outcome).__name__ for outcome in outcomes)


def quantile(ms: list[float], q: int) -> float:
    return round(statistics.quantiles(ms, n=100)[q - 1], 3) if len(ms) > 1 else float("nan")


async def measure(backend: LimiterBackend, sizes: Sizes) -> dict[str, object]:
    run = uuid.uuid4().hex[:8]
    flooder, other = f"flooder-{run}", f"other-{run}"
    await ordinary(backend, other, Sizes(0, 20, 0))  # warm: actor start, connection pool, script load
    quiet, quiet_unavailable = await ordinary(backend, other, sizes)
    holder = await acquire(backend, flooder, FLOODER)  # A's one slot, held all through the flood
    started = time.perf_counter()
    flooded, (busy, busy_unavailable) = await asyncio.gather(
        flood(backend, flooder, sizes), ordinary(backend, other, sizes)
    )
    flood_s = time.perf_counter() - started
    await holder.release(0)
    quiet_p99, flood_p99 = quantile(quiet, 99), quantile(busy, 99)
    return {
        "flood_requests": sizes.flood,
        "b_requests_per_phase": sizes.quiet,
        "quiet_p50_ms": quantile(quiet, 50),
        "quiet_p99_ms": quiet_p99,
        "flood_p50_ms": quantile(busy, 50),
        "flood_p99_ms": flood_p99,
        "flood_vs_quiet_p99": round(flood_p99 / quiet_p99, 2) if quiet_p99 > 0 else None,
        "b_unavailable": quiet_unavailable + busy_unavailable,
        "a_outcomes": dict(flooded),  # RateLimited: queue_full at once, or out of time in the queue
        "flood_phase_s": round(flood_s, 2),
    }


def make_backend(name: str) -> LimiterBackend:
    if name == "local":
        from app.limits.local_backend import LocalLimiter

        return LocalLimiter()
    if name == "ray":
        from app.limits.ray_backend import RayLimiter

        return RayLimiter(namespace=f"bench-{uuid.uuid4().hex[:6]}")
    from app.limits.redis_backend import RedisLimiter

    return RedisLimiter(REDIS_URL, key_prefix=f"loraplex-bench:{uuid.uuid4().hex[:6]}")


async def run_backend(name: str, sizes: Sizes) -> dict[str, object]:
    backend = make_backend(name)
    try:
        return await measure(backend, sizes)
    finally:
        if name == "redis":
            from app.limits.redis_backend import RedisLimiter

            assert isinstance(backend, RedisLimiter)
            await drop_keys(backend)
            await backend.aclose()


async def drop_keys(backend: "LimiterBackend") -> None:
    import redis.asyncio as aioredis

    prefix = getattr(backend, "key_prefix", "")
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        stale = [key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]
        if stale:
            await client.delete(*stale)
    finally:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=["local", "ray", "redis", "all"], default=None)
    parser.add_argument("--flood", type=int, default=1000, help="A's over-limit requests, all at once")
    parser.add_argument("--requests", type=int, default=400, help="B's requests per phase")
    parser.add_argument(
        "--tiny", action="store_true", help="a few seconds; checks that it runs, not the budget"
    )
    args = parser.parse_args()
    sizes = Sizes(flood=100, quiet=30, pace_s=0.002) if args.tiny else Sizes(args.flood, args.requests, 0.005)
    chosen = args.backend or ("local" if args.tiny else "all")
    names = ["local", "ray", "redis"] if chosen == "all" else [chosen]
    machine = cpu()
    isa = machine["isa"]
    assert isinstance(isa, list)
    print(f"cpu: {machine['cpu']} ({machine['cores']} cores), isa: {', '.join(isa) or 'baseline'}")
    if "ray" in names:
        import ray

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", include_dashboard=False, num_cpus=2, log_to_driver=False)
    results: dict[str, dict[str, object]] = {}
    try:
        for name in names:
            results[name] = result = asyncio.run(run_backend(name, sizes))
            print(
                f"{name:>5}: B quiet p50 {result['quiet_p50_ms']} ms p99 {result['quiet_p99_ms']} ms | "
                f"flood p50 {result['flood_p50_ms']} ms p99 {result['flood_p99_ms']} ms "
                f"(x{result['flood_vs_quiet_p99']}) | B unavailable {result['b_unavailable']} | "
                f"A {result['a_outcomes']}"
            )
    finally:
        if "ray" in names:
            import ray

            ray.shutdown()
    passed = all(
        r["b_unavailable"] == 0 and float(r["flood_p99_ms"]) < P99_BUDGET_MS  # type: ignore[arg-type]
        for r in results.values()
    )
    print(json.dumps({"bench": "limiter_flood", "tiny": args.tiny, **machine, "p99_budget_ms": P99_BUDGET_MS,
                      "passed": passed, "results": results}))  # fmt: skip
    if not args.tiny and not passed:
        sys.exit(1)


if __name__ == "__main__":
    main()
