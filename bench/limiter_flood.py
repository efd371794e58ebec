"""One tenant floods the rate limiter; does another tenant notice? (issue 14)

Per backend (local, ray, redis), through the real admission path (`Admission.acquire`, as one ingress
replica runs it): tenant B sends ordinary requests one after another, alone (quiet phase), and while
tenant A floods FLOOD over-limit requests on an `on_limit: queue` tier whose only concurrency slot is held
(flood phase: WAVES bursts of FLOOD / WAVES requests at once, spread over B's phase). The two phases run
in turns (quiet flood, flood quiet, ...), --repeats rounds, so a neighbour's burst on a shared VM hits
both. Prints B's admission latency p50/p99 in both phases (medians over the rounds, the flood/quiet p99
ratio per round with its spread), how often B was told the limiter is unavailable (a 503), what became
of A's requests, the machine, and last one JSON line.

Passes (exit 0) when B sees no unavailable answer and its median flood-phase p99 stays under 50 ms;
--tiny (a few seconds, a small flood, 2 rounds, the local backend unless --backend says otherwise) only
checks that it runs.

Run: python -m bench.limiter_flood [--backend local|ray|redis|all] [--flood 1000] [--repeats 5] [--tiny]
Redis: LORAPLEX_BENCH_REDIS (default redis://127.0.0.1:6379/0), under a key prefix of its own.
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass

from app.completions.admission import Admission
from app.limits import LimiterBackend, LimiterUnavailable, Limits
from bench.measure import machine, spread

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


async def flood_phase(
    backend: LimiterBackend, flooder: str, other: str, sizes: Sizes
) -> tuple[list[float], int, Counter[str], float]:
    """B's requests while A floods: (B's latencies, B's unavailable count, A's outcomes, phase seconds)."""
    holder = await acquire(backend, flooder, FLOODER)  # A's one slot, held all through the flood
    started = time.perf_counter()
    flooded, (busy, unavailable) = await asyncio.gather(
        flood(backend, flooder, sizes), ordinary(backend, other, sizes)
    )
    seconds = time.perf_counter() - started
    await holder.release(0)
    return busy, unavailable, flooded, seconds


async def measure(backend: LimiterBackend, sizes: Sizes, repeats: int) -> dict[str, object]:
    run = uuid.uuid4().hex[:8]
    flooder, other = f"flooder-{run}", f"other-{run}"
    await ordinary(backend, other, Sizes(0, 20, 0))  # warm: actor start, connection pool, script load
    p50: dict[str, list[float]] = {"quiet": [], "flood": []}
    p99: dict[str, list[float]] = {"quiet": [], "flood": []}
    unavailable, outcomes, flood_s = 0, Counter[str](), list[float]()
    for r in range(repeats):  # the phases in turns: quiet flood, flood quiet, ...
        for phase in ("quiet", "flood") if r % 2 == 0 else ("flood", "quiet"):
            if phase == "quiet":
                latencies, missed = await ordinary(backend, other, sizes)
            else:
                latencies, missed, flooded, seconds = await flood_phase(backend, flooder, other, sizes)
                outcomes += flooded
                flood_s.append(seconds)
            unavailable += missed
            p50[phase].append(quantile(latencies, 50))
            p99[phase].append(quantile(latencies, 99))
    ratios = [f / q for f, q in zip(p99["flood"], p99["quiet"], strict=True) if q > 0]
    ratio = spread(ratios) if ratios else None
    return {
        "flood_requests": sizes.flood,
        "b_requests_per_phase": sizes.quiet,
        "rounds": repeats,
        "quiet_p50_ms": round(statistics.median(p50["quiet"]), 3),
        "quiet_p99_ms": round(statistics.median(p99["quiet"]), 3),
        "flood_p50_ms": round(statistics.median(p50["flood"]), 3),
        "flood_p99_ms": round(statistics.median(p99["flood"]), 3),
        "flood_p99_max_ms": round(max(p99["flood"]), 3),  # the worst round
        "flood_vs_quiet_p99": round(ratio["median"], 2) if ratio else None,
        "flood_vs_quiet_p99_spread": ratio,
        "b_unavailable": unavailable,
        "a_outcomes": dict(outcomes),  # RateLimited: queue_full at once, or out of time in the queue
        "flood_phase_s": round(statistics.median(flood_s), 2),
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


async def run_backend(name: str, sizes: Sizes, repeats: int) -> dict[str, object]:
    backend = make_backend(name)
    try:
        return await measure(backend, sizes, repeats)
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
    parser.add_argument("--repeats", type=int, default=5, help="rounds of the quiet and the flood phase")
    parser.add_argument(
        "--tiny", action="store_true", help="a few seconds; checks that it runs, not the budget"
    )
    args = parser.parse_args()
    sizes = Sizes(flood=100, quiet=30, pace_s=0.002) if args.tiny else Sizes(args.flood, args.requests, 0.005)
    chosen = args.backend or ("local" if args.tiny else "all")
    names = ["local", "ray", "redis"] if chosen == "all" else [chosen]
    repeats = 2 if args.tiny else args.repeats
    host = machine()
    print(f"cpu: {host['cpu']} ({host['cores']} cores), isa: {', '.join(host['isa']) or 'baseline'}")
    if "ray" in names:
        import ray

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", include_dashboard=False, num_cpus=2, log_to_driver=False)
    results: dict[str, dict[str, object]] = {}
    try:
        for name in names:
            results[name] = result = asyncio.run(run_backend(name, sizes, repeats))
            print(
                f"{name:>5}: B quiet p50 {result['quiet_p50_ms']} ms p99 {result['quiet_p99_ms']} ms | "
                f"flood p50 {result['flood_p50_ms']} ms p99 {result['flood_p99_ms']} ms "
                f"(x{result['flood_vs_quiet_p99']} over {repeats} rounds) | "
                f"B unavailable {result['b_unavailable']} | "
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
    print(json.dumps({"bench": "limiter_flood", "tiny": args.tiny, "machine": host,
                      "p99_budget_ms": P99_BUDGET_MS, "passed": passed, "results": results}))  # fmt: skip
    if not args.tiny and not passed:
        sys.exit(1)


if __name__ == "__main__":
    main()
