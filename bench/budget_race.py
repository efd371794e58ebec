"""Budgets under a race (issue 29): many concurrent requests of one tenant whose prepaid credit covers
only some of them, through two ingress clients (each its own BudgetGuard and backend connection, as two
ingress replicas have) sharing one budget backend; and the same burst through a naive check-then-serve
variant (read the balance, serve if it covers the worst case, charge afterwards), which is what a budget
without reservations does.

Requests have fixed output lengths (output = max_tokens) and token prices only, so a reservation equals
the request's final cost: utilisation (settled spend / credit) shows how much credit the reservations
leave unused, overshoot (settled spend - credit) what the naive variant lets through. Also: the p50 of
Admission.acquire + release with budgets against without, interleaved on the same backend (--repeats
rounds; medians), which is what budgets add to each request's admission.

Run: python -m bench.budget_race [--requests 1000] [--covered 100] [--backends ray,redis] [--repeats 5];
the last line is one JSON object. --tiny: 100 requests, credit for 10, local and Redis, 2 rounds.
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import ray

from app.budgets.guard import BudgetGuard, periods_at
from app.budgets.local_backend import LocalBudgets
from app.budgets.protocol import BudgetBackend
from app.budgets.ray_backend import RayBudgets
from app.budgets.redis_backend import RedisBudgets
from app.completions.admission import Admission, BudgetAsk
from app.errors import BudgetUnavailable, InsufficientQuota
from app.limits import LimiterBackend, Limits
from app.limits.local_backend import LocalLimiter
from app.limits.redis_backend import RedisLimiter
from bench.measure import machine
from billing import credit, repository
from billing.db import make_engine, make_session_factory, session_scope
from billing.micros import from_micros, to_micros
from billing.migrate import upgrade
from billing.price_book import Metered, cost_of, worst_case
from billing.pricing import Prices

PROMPT, OUTPUT = 50, 200  # tokens of every request: its output is exactly max_tokens
PRICES = {"price_input_per_mtok": "2.5", "price_cached_input_per_mtok": "2.5", "price_output_per_mtok": "10"}
REDIS_URL = os.environ.get("LORAPLEX_BENCH_REDIS", "redis://127.0.0.1:6379/0")
LIMITS = Limits(rpm=10**9, tpm=10**12, max_concurrent=10**6)


class Database:
    """A SQLite billing database with the priced tier; one prepaid tenant per run."""

    def __init__(self, root: Path) -> None:
        url = f"sqlite:///{root / 'budgets.sqlite'}"
        upgrade(url)
        self.engine = make_engine(url)
        self.sessions = make_session_factory(self.engine)
        with session_scope(self.sessions) as s:
            repository.create_tier(s, name="metered", **PRICES)  # type: ignore[arg-type]

    def tenant(self, credit_amount: Decimal | None) -> str:
        with session_scope(self.sessions) as s:
            tenant = repository.create_tenant(s, name=f"t-{uuid.uuid4().hex[:8]}", tier="metered")
            if credit_amount is not None:
                credit.add_credit(s, tenant_id=tenant.id, amount=credit_amount, kind="topup", reason="bench",
                                  actor="bench")  # fmt: skip
            return tenant.id


def prices() -> Prices:
    return Prices("metered", "usd", Decimal("2.5"), Decimal("2.5"), Decimal("10"), Decimal(0))


def make_budgets(name: str, prefix: str) -> BudgetBackend:
    if name == "ray":
        return RayBudgets(namespace=prefix, timeout_s=30)
    if name == "redis":
        return RedisBudgets(REDIS_URL, key_prefix=f"loraplex-bench:{prefix}", timeout_s=60)
    raise ValueError(name)


async def race(
    db: Database, backend: str, requests: int, covered: int, shared: BudgetBackend | None
) -> dict[str, Any]:
    """`requests` at once across two ingress clients; credit for `covered` requests and a half."""
    per_request = cost_of(Metered(PROMPT, 0, OUTPUT), prices())
    credit_amount = (per_request * covered + per_request / 2).quantize(Decimal("0.000001"))
    tenant = db.tenant(credit_amount)
    prefix = uuid.uuid4().hex[:8]
    backends = [shared, shared] if shared is not None else [make_budgets(backend, prefix) for _ in range(2)]
    guards = [BudgetGuard(b, db.sessions, price_ttl_s=60) for b in backends]
    served = refused = unavailable = 0

    async def one(i: int) -> None:
        nonlocal served, refused, unavailable
        guard = guards[i % 2]
        try:
            hold = await guard.hold(tenant_id=tenant, budgeted=True, request_id=f"r{i}", base_model="m",
                                    adapter_id=None, prompt_tokens=PROMPT, output_tokens=OUTPUT)  # fmt: skip
        except InsufficientQuota:
            refused += 1
            return
        except BudgetUnavailable:  # the backend did not answer in time: refused, never served unchecked
            unavailable += 1
            return
        await asyncio.sleep(random.uniform(0, 0.005))  # the engine's work
        await guard.settle(hold, Metered(PROMPT, 0, OUTPUT))
        served += 1

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    elapsed = time.perf_counter() - start
    view = await guards[0].backend.peek(tenant, periods_at())
    assert view is not None
    spent = from_micros(view.spent_month)
    await _close(backends)
    return {"served": served, "refused": refused, "unavailable": unavailable, "credit": str(credit_amount),
            "spent": str(spent),
            "overshoot": str(spent - credit_amount), "utilisation": round(float(spent / credit_amount), 4),
            "reserved_after": view.reserved, "seconds": round(elapsed, 3)}  # fmt: skip


async def naive(db: Database, requests: int, covered: int) -> dict[str, Any]:
    """Check the balance, serve, charge afterwards: no reservation."""
    per_request = cost_of(Metered(PROMPT, 0, OUTPUT), prices())
    credit_amount = (per_request * covered + per_request / 2).quantize(Decimal("0.000001"))
    tenant = db.tenant(credit_amount)
    backend = LocalBudgets()
    guard = BudgetGuard(backend, db.sessions, price_ttl_s=60)
    await guard.load(tenant)
    amount = to_micros(worst_case(PROMPT, OUTPUT, prices()))
    served = 0

    async def one(i: int) -> None:
        nonlocal served
        view = await backend.peek(tenant, periods_at())
        assert view is not None and view.balance is not None
        if view.balance < amount:
            return
        await asyncio.sleep(random.uniform(0, 0.005))
        await backend.settle(tenant, f"r{i}", to_micros(per_request), periods_at())
        served += 1

    await asyncio.gather(*(one(i) for i in range(requests)))
    view = await backend.peek(tenant, periods_at())
    assert view is not None
    spent = from_micros(view.spent_month)
    return {"served": served, "credit": str(credit_amount), "spent": str(spent),
            "overshoot": str(spent - credit_amount)}  # fmt: skip


async def admission_overhead(db: Database, backend: str, n: int, repeats: int) -> dict[str, Any]:
    """Admission.acquire + release, with and without a BudgetAsk, interleaved; p50 per round."""
    prefix = uuid.uuid4().hex[:8]
    limiter: LimiterBackend = (
        LocalLimiter()
        if backend == "local"
        else RedisLimiter(REDIS_URL, key_prefix=f"loraplex-bench:{prefix}:rl")
    )
    budgets: BudgetBackend = LocalBudgets() if backend == "local" else make_budgets(backend, prefix)
    guard = BudgetGuard(budgets, db.sessions, price_ttl_s=3600)
    tenant = db.tenant(Decimal(10**6))

    async def once(with_budget: bool, i: int) -> float:
        ask = BudgetAsk(guard, True, "m", None, PROMPT, OUTPUT) if with_budget else None
        start = time.perf_counter()
        admission = await Admission.acquire(limiter, tenant=tenant, tier="metered", request_id=f"a{i}",
                                            limits=LIMITS, reserve=PROMPT + OUTPUT, fail_open=False,
                                            budget=ask)  # fmt: skip
        await admission.settle(Metered(PROMPT, 0, OUTPUT))
        await admission.release(PROMPT + OUTPUT)
        return (time.perf_counter() - start) * 1e3

    for i in range(20):  # warm: connections, scripts, the tenant's load and prices
        await once(True, -i - 1)
        await once(False, -i - 100)
    rounds: dict[str, list[float]] = {"with": [], "without": []}
    counter = 0
    for r in range(repeats):
        order = [True, False] if r % 2 == 0 else [False, True]
        for with_budget in order:
            samples = []
            for _ in range(n):
                counter += 1
                samples.append(await once(with_budget, counter))
            rounds["with" if with_budget else "without"].append(statistics.median(samples))
    added = [a - b for a, b in zip(rounds["with"], rounds["without"], strict=True)]
    await _close([budgets])
    if isinstance(limiter, RedisLimiter):
        await limiter.aclose()
    with_p50, without_p50 = statistics.median(rounds["with"]), statistics.median(rounds["without"])
    return {
        "with_p50_ms": round(with_p50, 4),
        "without_p50_ms": round(without_p50, 4),
        "added_p50_ms": round(statistics.median(added), 4),
        "added_per_round_ms": [round(a, 4) for a in added],
        "ratio": round(with_p50 / without_p50, 3),
    }


async def _close(backends: list[Any]) -> None:
    for backend in {id(b): b for b in backends}.values():
        if isinstance(backend, RedisBudgets):
            await backend.aclose()


async def measure(args: argparse.Namespace, names: list[str], root: Path) -> dict[str, Any]:
    db = Database(root)
    result: dict[str, Any] = {"requests": args.requests, "covered": args.covered}
    for name in names:
        shared = LocalBudgets() if name == "local" else None
        result[name] = await race(db, name, args.requests, args.covered, shared)
    result["naive"] = await naive(db, args.requests, args.covered)
    overhead_backend = "redis" if "redis" in names else names[0]
    result["admission"] = {"backend": overhead_backend,
                           **await admission_overhead(db, overhead_backend, args.n,
                                                      args.repeats)}  # fmt: skip
    db.engine.dispose()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1000, help="concurrent requests of the tenant")
    parser.add_argument("--covered", type=int, default=100, help="how many requests its credit covers")
    parser.add_argument("--backends", default="ray,redis", help="comma-separated: local, ray, redis")
    parser.add_argument("--n", type=int, default=300, help="admissions per round (overhead)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of each variant (overhead)")
    parser.add_argument("--tiny", action="store_true", help="100 requests, credit for 10, local and redis")
    args = parser.parse_args()
    if args.tiny:
        args.requests, args.covered, args.n, args.repeats = 100, 10, 30, 2
        args.backends = "local,redis"
    names = args.backends.split(",")
    if "ray" in names:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", include_dashboard=False, num_cpus=2, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as root:
            result = asyncio.run(measure(args, names, Path(root)))
    finally:
        if "ray" in names:
            ray.shutdown()
    print(json.dumps({"bench": "budget_race", "tiny": args.tiny, **result, "machine": machine()}))


if __name__ == "__main__":
    main()
