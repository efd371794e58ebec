"""The load test's invariants afterwards: statuses against fault windows, usage rows and tokens, leases,
and the Stripe export once healed."""

import contextlib
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from bench.load.options import SEED_PREFIX
from bench.load.platform import Platform
from bench.load.tenants import TenantSetup

if TYPE_CHECKING:
    from bench.locustfile import Result


def overlaps(result: "Result", windows: list[tuple[float, float]]) -> bool:
    return any(result.started <= end and result.ended >= start for start, end in windows)


def classify(results: list["Result"], windows: list[tuple[float, float]]) -> dict[str, list["Result"]]:
    """ok, intended 429, fault-excused (503/mid-stream error overlapping a fault), unexpected."""
    groups: dict[str, list[Result]] = {"ok": [], "rate_limited": [], "fault": [], "unexpected": []}
    for r in results:
        if r.outcome in ("ok", "rate_limited"):
            groups[r.outcome].append(r)
        elif r.outcome in ("unavailable", "stream_error") and overlaps(r, windows):
            groups["fault"].append(r)
        else:
            groups["unexpected"].append(r)
    return groups


def wait_for_usage(platform: Platform, results: list["Result"], timeout: float) -> dict[str, Any]:
    """Poll the usage table until every answered request has its row and the table has stopped growing
    (late failed/aborted rows from retried outboxes), or the timeout. Returns the rows by request id."""
    from sqlalchemy import select

    from billing.db import make_engine, make_session_factory
    from billing.models import UsageEvent

    wanted = {r.request_id for r in results if r.request_id and r.outcome in ("ok", "stream_error")}
    engine = make_engine(platform.database_url)
    sessions = make_session_factory(engine)
    deadline = time.monotonic() + timeout
    stable_since, last_count = time.monotonic(), -1
    rows: dict[str, Any] = {}
    try:
        while True:
            with contextlib.suppress(Exception), sessions() as session:
                query = select(UsageEvent).where(~UsageEvent.request_id.startswith(SEED_PREFIX))
                rows = {row.request_id: row for row in session.scalars(query)}
            if len(rows) != last_count:
                stable_since, last_count = time.monotonic(), len(rows)
            settled = time.monotonic() - stable_since > 10
            if (wanted <= rows.keys() and settled) or time.monotonic() > deadline:
                return rows
            time.sleep(1)
    finally:
        engine.dispose()


def check_usage(results: list["Result"], rows: dict[str, Any], tenants: list[TenantSetup]) -> dict[str, Any]:
    """Per tenant: a completed row for each 200, a failed/aborted row for each mid-stream failure, no
    other rows but failed/aborted ones for requests that failed on the server, tokens as answered."""
    report: dict[str, Any] = {"tenants": {}, "ok": True, "tokens_ok": True}
    for tenant in tenants:
        mine = [r for r in results if r.tenant == tenant.name]
        theirs = {k: v for k, v in rows.items() if v.tenant_id == tenant.tenant_id}
        served = {r.request_id: r for r in mine if r.outcome == "ok" and r.request_id}
        broken = {r.request_id: r for r in mine if r.outcome == "stream_error" and r.request_id}
        server_failures = sum(1 for r in mine if r.status >= 500 or r.outcome in ("transport", "truncated"))
        missing = sorted(set(served) - theirs.keys())
        missing_failed = sorted(set(broken) - theirs.keys())
        wrong = sorted(i for i in served if i in theirs and theirs[i].status != "completed")
        wrong += sorted(i for i in broken if i in theirs and theirs[i].status not in ("failed", "aborted"))
        extra = sorted(theirs.keys() - served.keys() - broken.keys())
        extra_completed = [i for i in extra if theirs[i].status == "completed"]
        tokens_off = [
            i for i, r in served.items()
            if i in theirs and r.usage is not None
            and (theirs[i].prompt_tokens, theirs[i].completion_tokens) != r.usage
        ]  # fmt: skip
        ok = not (missing or missing_failed or wrong or extra_completed) and len(extra) <= server_failures
        report["tenants"][tenant.name] = {
            "rows": len(theirs),
            "served_200": len(served),
            "failed_mid_stream": len(broken),
            "rows_failed_or_aborted": sum(1 for v in theirs.values() if v.status in ("failed", "aborted")),
            "missing": missing[:5],
            "missing_count": len(missing) + len(missing_failed),
            "wrong_status": wrong[:5],
            "unexplained_rows": len(extra),
            "unexplained_completed": extra_completed[:5],
            "server_failures": server_failures,
            "tokens_mismatch": tokens_off[:5],
            "ok": ok,
        }
        report["ok"] = report["ok"] and ok
        report["tokens_ok"] = report["tokens_ok"] and not tokens_off
    return report


def check_leases(platform: Platform, tenants: list[TenantSetup]) -> dict[str, Any]:
    """Every tenant's live concurrency leases and queued waiters, read from the limiter itself."""
    ids = {t.tenant_id: t.name for t in tenants}
    if platform.redis is not None:
        import redis

        # Straight to the server, not through the proxy the platform uses.
        client = redis.Redis(port=platform.redis.port, socket_timeout=10, decode_responses=True)
        try:
            seconds, micros = client.time()
            now_ms = seconds * 1000 + micros // 1000
            counts: dict[str, dict[str, Any]] = {}
            for tid, name in ids.items():
                live = client.zrangebyscore(f"loraplex:rl:{{{tid}}}:leases", f"({now_ms}", "+inf")
                counts[name] = {
                    "leases": len(live),
                    "queued": int(client.zcard(f"loraplex:rl:{{{tid}}}:queue")),
                    "ids": sorted(str(member) for member in live)[:20],
                }
        finally:
            client.close()
        return {"ok": True, "tenants": counts}
    found = platform.ray_ops("leases", timeout=180)
    if not found.get("ok"):
        return {"ok": False, "error": found.get("error"), "tenants": {}}
    counts = {ids.get(tid, tid): c for tid, c in found.get("tenants", {}).items() if tid in ids}
    return {"ok": True, "tenants": counts}


def check_stripe(platform: Platform, sessions_url: str) -> dict[str, Any]:
    """Stripe healed: a full rollup and export must deliver everything, `billing reconcile` must find no
    discrepancy, and the stub's totals must equal the rollups of every closed hour (nothing lost, nothing
    counted twice)."""
    from sqlalchemy import select

    from billing.db import make_engine, make_session_factory
    from billing.models import Tenant, UsageRollup
    from billing.stripe_config import StripeConfig
    from billing.stripe_export import meter_values
    from billing.usage import closed_before, hour_of

    platform.stub.heal()
    now = datetime.now(UTC)
    rollup_code, _ = platform.loraplex("billing", "rollup", "--hours", "8")
    export_code, summary = platform.loraplex("billing", "export")
    start = (hour_of(now) - timedelta(hours=7)).strftime("%Y-%m-%dT%H:00Z")
    end = (hour_of(now) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:00Z")
    reconcile_code, reconciled = platform.loraplex("billing", "reconcile", "--start", start, "--end", end)
    names = StripeConfig(api_key=platform.stub.api_key).event_names()
    expected: Counter[tuple[str, str]] = Counter()
    engine = make_engine(sessions_url)
    try:
        with make_session_factory(engine)() as session:
            customers = {t.id: t.stripe_customer_id for t in session.scalars(select(Tenant))}
            cutoff = closed_before(datetime.now(UTC))
            for rollup in session.scalars(select(UsageRollup).where(UsageRollup.hour < cutoff)):
                customer = customers.get(rollup.tenant_id)
                if customer:
                    for key, value in meter_values(rollup).items():
                        expected[(customer, names[key])] += value
    finally:
        engine.dispose()
    at_stripe = platform.stub.totals()
    identifiers = [e.identifier for e in list(platform.stub.events)]
    agree = {k: v for k, v in expected.items() if v} == {k: v for k, v in at_stripe.items() if v}
    ok = (
        rollup_code == 0
        and export_code == 0
        and summary.get("failed") == 0
        and summary.get("pending") == 0
        and reconcile_code == 0
        and agree
        and len(identifiers) == len(set(identifiers))
        and bool(expected)
    )
    return {
        "ok": ok,
        "export_exit": export_code,
        "export": {k: summary.get(k) for k in ("created", "sent", "failed", "duplicates", "pending")},
        "reconcile_exit": reconcile_code,
        "discrepancies": reconciled.get("discrepancies", reconciled) if reconcile_code else [],
        "stripe_events": len(identifiers),
        "stub_replays": platform.stub.replays,
        "stub_refused_duplicates": len(platform.stub.duplicates),
        "totals_agree": agree,
        "customers": sorted({c for c, _ in expected}),
    }


def check_budgets(platform: Platform, tenants: list[TenantSetup], timeout: float) -> dict[str, Any]:
    """Each prepaid tenant once the faults are over, as it sees itself (GET /v1/limits): nothing left
    reserved (a hold whose request was cut short is settled, or lapses at its expiry), the spend the budget
    backend settled equals its usage rows' costs in the database to the cent, and never exceeds its
    credit."""
    from decimal import Decimal

    import httpx
    from sqlalchemy import func, select

    from billing.db import make_engine, make_session_factory
    from billing.models import CreditEntry, UsageEvent

    report: dict[str, Any] = {"ok": True, "tenants": {}}
    engine = make_engine(platform.database_url)
    try:
        for tenant in tenants:
            with make_session_factory(engine)() as session:
                credit = session.scalar(
                    select(func.sum(CreditEntry.amount)).where(CreditEntry.tenant_id == tenant.tenant_id)
                )
            if credit is None:
                continue
            deadline = time.monotonic() + timeout
            budget: dict[str, Any] = {}
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    answer = httpx.get(f"{platform.url}/v1/limits", timeout=10,
                                       headers={"authorization": f"Bearer {tenant.key}"})  # fmt: skip
                    if answer.status_code == 200:
                        budget = answer.json().get("budget") or {}
                        if Decimal(budget.get("reserved", "1")) == 0:
                            break
                time.sleep(2)
            month_start = datetime.now(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
            with make_session_factory(engine)() as session:
                rows_cost = session.scalar(
                    select(func.coalesce(func.sum(UsageEvent.cost), 0)).where(
                        UsageEvent.tenant_id == tenant.tenant_id, UsageEvent.started_at >= month_start
                    )
                )
                rows = session.scalar(select(func.count()).where(UsageEvent.tenant_id == tenant.tenant_id))
            spent = Decimal(budget.get("spent_this_month", "-1"))
            reserved = Decimal(budget.get("reserved", "-1"))
            settled = Decimal(str(rows_cost))
            ok = bool(budget) and reserved == 0 and abs(spent - settled) < Decimal("0.01")
            ok = ok and Decimal(0) < spent <= Decimal(str(credit))
            report["tenants"][tenant.name] = {
                "ok": ok, "credit": str(credit), "spent": str(spent), "rows_cost": str(settled),
                "usage_rows": rows, "reserved": str(reserved), "balance": budget.get("balance"),
            }  # fmt: skip
            report["ok"] = report["ok"] and ok
    finally:
        engine.dispose()
    report["ok"] = report["ok"] and bool(report["tenants"])
    return report
