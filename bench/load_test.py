"""Load test with faults, end to end through `serve run`: mixed tenants, adapters, chat and completions,
streamed and not, for minutes, while an engine replica, the Metering replica, the database and Redis are
knocked out and the Stripe stub fails under `loraplex billing export`; then the books are checked.

It prepares a fresh data dir the way `loraplex up` does (app.demo.prepare: migrations, demo model, public
demo adapters), adds tenants on four tiers (one tight: its 429s are intended) and some closed-hour usage
for the Stripe export, starts a Ray cluster of its own (loopback, free ports, never 6379), runs
`serve run` on a config derived from serve_config.yaml, and drives bench/locustfile.py's users in this
process. Invariants afterwards: only 200s and intended 429s (503s and mid-stream engine errors only for
requests that overlap a fault), no hung request, no concurrency lease left in the limiter, one usage row
per request served (failed/aborted rows only for requests that failed), tokens as answered, and Stripe's
totals equal to the rollups once the stub is healed (`loraplex billing reconcile`).

Run: python -m bench.load_test --duration 300 [--faults engine,metering,db,redis,stripe]
     [--backend ray|redis] [--database sqlite|postgres] [--users 8] [--keep] [--tiny]
The last line is one JSON object; the exit status is 1 if any invariant failed.
"""

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from bench.load.checks import (
    check_budgets,
    check_leases,
    check_stripe,
    check_usage,
    classify,
    wait_for_usage,
)
from bench.load.driver import run_load
from bench.load.fault_injector import FaultInjector
from bench.load.options import FAULTS, Interrupted, Options, progress
from bench.load.platform import Platform
from bench.load.probes import probes, wait_ready
from bench.load.report import dump_results, percentile, summary_table
from bench.load.tenants import prepare, write_plan
from bench.measure import machine

if TYPE_CHECKING:
    from bench.locustfile import Result


def parse(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench.load_test", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    parser.add_argument("--faults", default="", help=f"comma-separated, in order: {','.join(FAULTS)}")
    parser.add_argument(
        "--backend",
        choices=["ray", "redis"],
        default=None,
        help="rate-limiter backend (default: redis if the redis fault is asked for, else ray)",
    )
    parser.add_argument(
        "--database",
        choices=["sqlite", "postgres"],
        default="sqlite",
        help="postgres: a fresh database on LORAPLEX_TEST_POSTGRES_URL's server",
    )
    parser.add_argument("--users", type=int, default=8, help="concurrent simulated clients (default 8)")
    parser.add_argument("--outage", type=float, default=None, help="seconds each db/redis outage lasts")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs, database) afterwards")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="the least load the checks accept (20 s, 4 users), faults only if asked: checks that it runs; "
        "still a few minutes, as Ray and `serve run` start",
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.duration, args.users = 20.0, 4
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        parser.error(f"unknown fault(s) {unknown}; known: {', '.join(FAULTS)}")
    backend = args.backend or ("redis" if "redis" in faults else "ray")
    if "redis" in faults and backend != "redis":
        parser.error("the redis fault needs --backend redis")
    if args.duration < 20 or args.users < 4:
        parser.error("--duration must be at least 20 and --users at least 4 (one per tenant)")
    return Options(args.duration, faults, backend, args.database, args.users, args.keep, args.outage)


def main(argv: list[str] | None = None) -> int:
    # Before anything imports locust (bench.locustfile): gevent without monkey-patching. The users'
    # FastHttpUser client is gevent-native; the fault threads, Stripe stub and Redis proxy stay real
    # threads and never block the users' hub (patching after threads exist would break them).
    os.environ["LOCUST_SKIP_MONKEY_PATCH"] = "1"
    logging.getLogger("httpx").setLevel(logging.WARNING)
    options = parse(argv)
    workdir = Path(tempfile.mkdtemp(prefix="lpb-", dir="/tmp"))  # short: Ray's socket paths live in it
    platform = Platform(options, workdir)
    terminating = threading.Event()
    in_hub = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        terminating.set()
        if not in_hub.is_set():  # outside the gevent loop an exception is safe; inside, the loop polls
            raise Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    output: dict[str, Any] = {
        "bench": "load_test", "duration_s": options.duration, "workdir": str(workdir), "machine": machine(),
    }  # fmt: skip
    invariants: dict[str, bool] = {}
    injector = FaultInjector(platform, options.faults, options.duration, options.outage_s)
    try:
        progress(f"work dir {workdir}; backend {options.backend}; database {options.database}; "
             f"faults {options.faults or 'none'}")  # fmt: skip
        platform.start_services()
        config = platform.serve_config()
        progress("preparing data (migrations, demo model and adapters, tenants)...")
        tenants = prepare(platform, config, options.users)
        plan = write_plan(platform, tenants)
        progress(f"starting Ray (GCS {platform.gcs}) and serve run on {platform.url}...")
        platform.start_ray()
        platform.start_serve(config)
        extra: list[Result] = []
        wait_ready(platform, tenants, extra, timeout=600)
        progress(f"ready; load for {options.duration:.0f}s with {options.users} users")
        in_hub.set()
        results, t0, hung = run_load(platform, plan, options, injector, terminating.is_set)
        in_hub.clear()
        if terminating.is_set():
            raise Interrupted("signal during the load")
        progress(
            f"load done: {len(results)} requests; waiting for faults to finish and the platform to recover"
        )
        injector.join(timeout=420)
        injector.cancel()
        healthy = platform.ray_ops("--expect", platform.expected(), "--timeout", "300", "healthy")
        probed_ok, probe_results = probes(platform, tenants, timeout=180)
        extra += probe_results
        progress("waiting for metering to drain...")
        everything = results + extra
        rows = wait_for_usage(platform, everything, timeout=300)
        leases = check_leases(platform, tenants)
        usage = check_usage(everything, rows, tenants)
        groups = classify(results, injector.windows())
        ids = [r.request_id for r in everything if r.request_id]
        tight = [t for t in tenants if t.name == "bench-tight"]
        invariants = {
            "only_expected_statuses": not groups["unexpected"],
            "no_hung_requests": hung == 0,
            "intended_429s_seen": any(r.tenant in {t.name for t in tight} for r in groups["rate_limited"]),
            "no_leaked_leases": leases.get("ok", False)
            and all(c.get("leases", 0) == 0 and c.get("queued", 0) == 0 for c in leases["tenants"].values()),
            "usage_rows_match_served": usage["ok"],
            "usage_tokens_match": usage["tokens_ok"],
            "no_duplicate_request_ids": len(ids) == len(set(ids)),
            "platform_recovered": bool(healthy.get("ok")) and probed_ok,
            "faults_injected": all(r.ok for r in injector.records.values())
            and all(r.started_at is not None for r in injector.records.values()),
        }
        # Holds of requests cut short settle at once; one whose ingress was lost lapses at HOLD_TTL_MS.
        budgets = check_budgets(platform, tenants, timeout=150)
        invariants["budgets_settled_and_reconciled"] = budgets["ok"]
        stripe: dict[str, Any] | None = None
        if "stripe" in options.faults:
            stripe = check_stripe(platform, platform.database_url)
            invariants["stripe_export_reconciled"] = stripe["ok"]
        ok_latency = [r.latency_ms for r in groups["ok"]]
        span = max((r.ended for r in results), default=t0) - t0
        print(summary_table(results, tenants, groups, usage, leases), flush=True)
        for r in groups["unexpected"][:10]:
            print(f"  unexpected: t={r.started - t0:.1f}..{r.ended - t0:.1f}s {r.tenant} {r.kind} "
                  f"stream={r.stream} {r.model} -> {r.status} {r.outcome} {r.error_code or ''} "
                  f"{r.detail[:160]}", flush=True)  # fmt: skip
        for name, held in leases.get("tenants", {}).items():
            for lease_id in held.get("ids", []):
                owner = next((r for r in everything if r.request_id == lease_id), None)
                seen = ""
                if owner is not None:
                    when = f"t={owner.started - t0:.1f}..{owner.ended - t0:.1f}s"
                    seen = f" (its request: {owner.status} {owner.outcome}, {when})"
                print(f"  lease still held: {name} {lease_id}{seen}", flush=True)
        dump_results(workdir / "results.jsonl", everything, t0)
        faults = {name: rec.as_json(t0) for name, rec in injector.records.items()}
        if stripe is not None:
            faults.setdefault("stripe", {})["after_recovery"] = stripe
        output.update(
            requests=len(results),
            rps=round(len(results) / span, 2) if span > 0 else 0.0,
            p50_ms=percentile(ok_latency, 50),
            p95_ms=percentile(ok_latency, 95),
            status_counts={str(k): v for k, v in sorted(Counter(r.status for r in results).items())},
            outcomes={
                "ok": len(groups["ok"]),
                "intended_429": len(groups["rate_limited"]),
                "fault_503": sum(1 for r in groups["fault"] if r.outcome == "unavailable"),
                "fault_stream_error": sum(1 for r in groups["fault"] if r.outcome == "stream_error"),
                "unexpected": len(groups["unexpected"]),
            },
            backend=options.backend,
            database=options.database,
            faults=faults,
            usage_rows=len(rows),
            leases=leases.get("tenants"),
            budgets=budgets["tenants"],
            invariants=invariants,
        )
    except Interrupted as stopped:
        injector.cancel()
        invariants["completed"] = False
        output["error"] = f"interrupted ({stopped})"
    except Exception as error:
        injector.cancel()
        invariants["completed"] = False
        output["error"] = f"{type(error).__name__}: {error}"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # cleanup must not be cut short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        platform.close()
    passed = bool(invariants) and all(invariants.values())
    output["invariants"] = invariants
    if passed and not options.keep:
        shutil.rmtree(workdir, ignore_errors=True)
        output.pop("workdir")
    else:
        progress(f"work dir kept: {workdir} (serve.log, ray.log, data/loraplex.db)")
    if not passed:
        (workdir / "report.json").write_text(json.dumps(output, indent=2))
    print(json.dumps(output), flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
