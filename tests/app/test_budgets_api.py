"""Budgets and credit through the real HTTP API (issue 29): top-up, reserve, settle, refuse with 429
insufficient_quota before any work, spend limits hard and soft, the surfaces (GET /v1/limits, admin
credit and budgets), every usage row priced, and budgets failing closed when their state is away."""

import json
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from decimal import Decimal

import httpx
import pytest
from sqlalchemy import func, select
from typer.testing import Result

from app.budgets.local_backend import LocalBudgets
from app.budgets.redis_backend import RedisBudgets
from billing import credit
from billing.models import Tenant, UsageEvent, utcnow
from tests.app.conftest import MODEL, Served
from tests.app.helpers import wait_for
from tests.billing.test_usage_queries import make_event

# Dear enough that a few tokens are real money: 1 per million input tokens is 0.000001 each.
PRICES = {"price_input_per_mtok": "1000", "price_cached_input_per_mtok": "1000",
          "price_output_per_mtok": "2000"}  # fmt: skip


@pytest.fixture(scope="module")
def metered_tier(served: Served) -> str:
    with served.admin() as admin:
        reply = admin.post("/admin/tiers", json={"name": "metered", "description": "priced", **PRICES})
        assert reply.status_code == 201, reply.text
    return "metered"


def new_tenant(served: Served, tier: str) -> tuple[str, str]:
    return served.new_tenant(f"b-{uuid.uuid4().hex[:8]}", tier=tier)


def chat(served: Served, key: str, max_tokens: int, content: str = "hi") -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    return httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {key}"})  # fmt: skip


def limits(served: Served, key: str) -> httpx.Response:
    return httpx.get(f"{served.url}/v1/limits", headers={"authorization": f"Bearer {key}"}, timeout=30)


def top_up(served: Served, tenant_id: str, amount: str, kind: str = "topup") -> httpx.Response:
    with served.admin() as admin:
        return admin.post(f"/admin/tenants/{tenant_id}/credit",
                          json={"amount": amount, "kind": kind, "reason": "test",
                                "actor": "ops"})  # fmt: skip


def costs(served: Served, tenant_id: str) -> list[Decimal | None]:
    with served.services.session_factory() as session:
        query = select(UsageEvent.cost).where(UsageEvent.tenant_id == tenant_id)
        return [None if c is None else Decimal(str(c)) for c in session.scalars(query)]


def cost_of(reply: dict[str, object]) -> Decimal:
    usage = reply["usage"]
    assert isinstance(usage, dict)
    return (Decimal(usage["prompt_tokens"]) * 1000 + Decimal(usage["completion_tokens"]) * 2000) / 10**6


def test_top_up_reserve_settle_and_refuse_before_any_work(served: Served, metered_tier: str) -> None:
    tenant_id, key = new_tenant(served, metered_tier)
    auth_ttl = served.services.settings.auth_cache_ttl_s
    assert top_up(served, tenant_id, "0.05").status_code == 201
    time.sleep(auth_ttl * 2)  # the key's cached principal learns it is prepaid
    shown = limits(served, key).json()["budget"]
    assert shown["prepaid"] is True and shown["balance"] == "0.050000" and shown["reserved"] == "0.000000"

    served_reply = chat(served, key, max_tokens=4)
    assert served_reply.status_code == 200, served_reply.text
    assert Decimal(served_reply.headers["x-budget-remaining"]) < Decimal("0.05")
    assert served_reply.headers["x-budget-currency"] == "usd"
    spent = cost_of(served_reply.json())
    wait_for(lambda: costs(served, tenant_id) == [spent])

    # 1000 output tokens at 0.002 each is 2.00: far past the credit, refused before any engine runs.
    refused = chat(served, key, max_tokens=1000)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "insufficient_quota",
        None,
    )
    assert "prepaid credit" in error["message"] and refused.headers["x-should-retry"] == "false"
    assert tenant_id not in error["message"]  # no internals
    time.sleep(0.5)
    assert costs(served, tenant_id) == [spent]  # nothing ran, nothing was metered

    shown = limits(served, key).json()["budget"]
    assert Decimal(shown["balance"]) == Decimal("0.05") - spent and shown["reserved"] == "0.000000"
    with served.admin() as admin:
        ledger = admin.get(f"/admin/tenants/{tenant_id}/credit").json()
    assert [(e["amount"], e["kind"], e["actor"]) for e in ledger["entries"]] == [("0.050000", "topup", "ops")]


def test_bad_credit_is_a_clear_400(served: Served, metered_tier: str) -> None:
    tenant_id, _ = new_tenant(served, metered_tier)
    for amount in ("-1", "0", "0.0000001", "abc"):
        reply = top_up(served, tenant_id, amount)
        assert reply.status_code == 400, (amount, reply.text)
        assert reply.json()["error"]["param"] == "amount"
    with served.admin() as admin:
        assert admin.post("/admin/tenants/ten_nobody/credit", json={"amount": "1"}).status_code == 404


def test_hard_daily_limit_refuses_and_soft_monthly_limit_warns_once(
    served: Served, metered_tier: str
) -> None:
    tenant_id, key = new_tenant(served, metered_tier)
    with served.admin() as admin:
        limits_body = {"day": {"amount": "0.2", "hard": True}, "month": {"amount": "0.001", "hard": False}}
        reply = admin.put(f"/admin/tenants/{tenant_id}/budgets", json=limits_body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["limits"]["day"]["amount"] == "0.200000"
    time.sleep(served.services.settings.auth_cache_ttl_s * 2)
    ok = chat(served, key, max_tokens=4)
    assert ok.status_code == 200, ok.text
    again = chat(served, key, max_tokens=4)
    assert again.status_code == 200  # the soft limit only warns
    refused = chat(served, key, max_tokens=150)  # 0.30 of output alone: past the day's 0.20
    assert refused.status_code == 429 and "daily spend limit" in refused.json()["error"]["message"]
    shown = limits(served, key).json()["budget"]
    assert shown["prepaid"] is False and shown["balance"] is None
    assert len(shown["soft_limit_events"]) == 1 and shown["soft_limit_events"][0].startswith("month:")
    with served.services.session_factory() as session:
        periods = [credit.period_key("day", utcnow()), credit.period_key("month", utcnow())]
        assert len(credit.events(session, tenant_id=tenant_id, period_keys=periods)) == 1


def test_every_usage_row_is_priced_and_prices_have_history(served: Served, metered_tier: str) -> None:
    tenant_id, key = new_tenant(served, metered_tier)  # no credit, no limits: priced all the same
    first = chat(served, key, max_tokens=3)
    wait_for(lambda: costs(served, tenant_id) == [cost_of(first.json())])
    with served.admin() as admin:
        assert admin.patch("/admin/tiers/metered", json={"price_output_per_mtok": "4000"}).status_code == 200
    time.sleep(served.services.settings.auth_cache_ttl_s * 2)  # the price cache's TTL
    second = chat(served, key, max_tokens=3).json()
    usage = second["usage"]
    dearer = (Decimal(usage["prompt_tokens"]) * 1000 + Decimal(usage["completion_tokens"]) * 4000) / 10**6
    wait_for(lambda: len(costs(served, tenant_id)) == 2)
    assert sorted(c for c in costs(served, tenant_id) if c is not None) == sorted(
        [cost_of(first.json()), dearer]
    )
    with served.admin() as admin:  # put it back for the other tests
        admin.patch("/admin/tiers/metered", json={"price_output_per_mtok": "2000"})


def test_budgets_fail_closed_when_their_state_is_away(served: Served, metered_tier: str) -> None:
    tenant_id, key = new_tenant(served, metered_tier)
    _, free_key = new_tenant(served, metered_tier)
    top_up(served, tenant_id, "1")
    time.sleep(served.services.settings.auth_cache_ttl_s * 2)
    guard = served.services.budget_guard
    assert guard is not None
    outage = RedisBudgets("redis://127.0.0.1:1/0", timeout_s=0.5)
    kept, guard.backend = guard.backend, outage
    try:
        refused = chat(served, key, max_tokens=2)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "budget_unavailable"
        assert chat(served, free_key, max_tokens=2).status_code == 200  # no budget: nothing to check
    finally:
        guard.backend = kept


def test_a_restarted_backend_reloads_from_the_ledger(served: Served, metered_tier: str) -> None:
    tenant_id, key = new_tenant(served, metered_tier)
    top_up(served, tenant_id, "0.5")
    time.sleep(served.services.settings.auth_cache_ttl_s * 2)
    reply = chat(served, key, max_tokens=4)
    wait_for(lambda: len(costs(served, tenant_id)) == 1)
    guard = served.services.budget_guard
    assert guard is not None and isinstance(guard.backend, LocalBudgets)
    guard.backend.state.forget(tenant_id)  # what a restarted limiter holds: nothing
    shown = limits(served, key).json()["budget"]
    assert Decimal(shown["balance"]) == Decimal("0.5") - cost_of(reply.json())
    with served.services.session_factory() as session:
        total = session.scalar(select(func.count()).where(UsageEvent.tenant_id == tenant_id))
    assert total == 1


def test_cli_credit_and_budgets(served: Served, metered_tier: str, cli: Callable[..., Result]) -> None:
    tenant_id, _ = new_tenant(served, metered_tier)
    added = cli("--json", "credit", "add", tenant_id, "12.5", "--reason", "invoice 42", "--actor", "finance")
    assert added.exit_code == 0, added.output
    assert json.loads(added.stdout)["amount"] == "12.500000"
    limited = cli("budgets", "set", tenant_id, "--day", "3", "--month", "50", "--soft")
    assert limited.exit_code == 0, limited.output
    assert "day limit" in limited.stdout and "(soft)" in limited.stdout
    shown = cli("--json", "credit", "show", tenant_id)
    budget = json.loads(shown.stdout)
    assert budget["balance"] == "12.500000" and budget["limits"]["month"]["hard"] is False
    assert [(e["reason"], e["actor"]) for e in budget["entries"]] == [("invoice 42", "finance")]
    human = cli("credit", "show", tenant_id)
    assert human.exit_code == 0 and "invoice 42" in human.stdout
    refused = cli("credit", "add", tenant_id, "0")
    assert refused.exit_code != 0 and "amount" in refused.output


def settled_long_ago(served: Served, tenant_id: str, cost: str, days: int) -> None:
    """A usage row settled `days` ago, while the tenant was postpaid (Stripe invoices such hours)."""
    started = utcnow() - timedelta(days=days)
    with served.services.session_factory() as session, session.begin():
        session.add(make_event(tenant_id, started, cost=Decimal(cost), currency="usd"))


def test_postpaid_usage_before_the_first_top_up_is_not_charged_to_credit(
    served: Served, metered_tier: str
) -> None:
    """Issue 35, item 3: 80.00 of usage 20 days old, then a 100.00 top-up: the credit is 100.00 (it was
    20.00, while the old rollup was still invoiced). Usage from the top-up's hour on is charged to it."""
    tenant_id, key = new_tenant(served, metered_tier)
    settled_long_ago(served, tenant_id, "80", days=20)
    assert top_up(served, tenant_id, "100").status_code == 201
    with served.admin() as admin:
        shown = admin.get(f"/admin/tenants/{tenant_id}/credit").json()
    assert (shown["prepaid"], shown["balance"]) == (True, "100.000000")
    with served.services.session_factory() as session:
        tenant = session.get(Tenant, tenant_id)
        assert tenant is not None and tenant.prepaid_since is not None
        assert tenant.prepaid_since == credit.credit_entries(session, tenant_id=tenant_id)[0].created_at
    time.sleep(served.services.settings.auth_cache_ttl_s * 2)
    reply = chat(served, key, max_tokens=4)
    assert reply.status_code == 200, reply.text
    wait_for(lambda: len(costs(served, tenant_id)) == 2)
    shown = limits(served, key).json()["budget"]
    assert Decimal(shown["balance"]) == Decimal(100) - cost_of(reply.json())


def test_a_negative_adjustment_does_not_make_a_postpaid_tenant_prepaid(
    served: Served, metered_tier: str
) -> None:
    """Issue 35, item 3: a -1.00 correction of a postpaid tenant made it prepaid with -1.00 of credit, and
    every request after it was refused. A postpaid tenant has no credit to correct: a 400, nothing written."""
    tenant_id, key = new_tenant(served, metered_tier)
    refused = top_up(served, tenant_id, "-1.00", kind="adjustment")
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error", "amount", "tenant_not_prepaid",
    )  # fmt: skip
    assert "postpaid" in error["message"]
    time.sleep(served.services.settings.auth_cache_ttl_s * 2)
    served_reply = chat(served, key, max_tokens=4)
    assert served_reply.status_code == 200
    wait_for(lambda: len(costs(served, tenant_id)) == 1)
    shown = limits(served, key).json()["budget"]
    assert shown is None or (shown["prepaid"], shown["balance"]) == (False, None)
    with served.admin() as admin:
        ledger = admin.get(f"/admin/tenants/{tenant_id}/credit").json()
    assert ledger["entries"] == [] and ledger["prepaid"] is False
    # A positive adjustment is credit granted: it makes the tenant prepaid like a top-up, from the start of
    # this hour (the request above is in it: not invoiced, so credit pays for it).
    assert top_up(served, tenant_id, "2.00", kind="adjustment").status_code == 201
    assert top_up(served, tenant_id, "-0.50", kind="adjustment").status_code == 201
    with served.admin() as admin:
        shown = admin.get(f"/admin/tenants/{tenant_id}/credit").json()
    assert shown["prepaid"] is True
    assert Decimal(shown["balance"]) == Decimal("1.5") - cost_of(served_reply.json())


def test_the_ledger_records_the_request_and_the_surface_beside_the_actor(
    served: Served, metered_tier: str, cli: Callable[..., Result]
) -> None:
    """Issue 35, item 8: `actor` is whatever the body says; the request id (in the access log with the admin
    key's use) and the surface (admin API, or the CLI through it) are recorded by the server beside it."""
    tenant_id, _ = new_tenant(served, metered_tier)
    reply = top_up(served, tenant_id, "1")
    assert reply.status_code == 201, reply.text
    entry = reply.json()
    assert (entry["surface"], entry["request_id"]) == ("admin_api", reply.headers["x-request-id"])
    assert entry["request_id"].startswith("req_")
    added = cli("--json", "credit", "add", tenant_id, "2", "--actor", "finance")
    assert added.exit_code == 0, added.output
    assert json.loads(added.stdout)["surface"] == "cli"
    with served.admin() as admin:
        ledger = admin.get(f"/admin/tenants/{tenant_id}/credit").json()["entries"]
    assert [(e["actor"], e["surface"]) for e in ledger] == [("ops", "admin_api"), ("finance", "cli")]
    assert len({e["request_id"] for e in ledger}) == 2 and all(
        e["request_id"].startswith("req_") for e in ledger
    )
    human = cli("credit", "show", tenant_id)
    assert human.exit_code == 0 and "cli" in human.stdout


def test_a_top_up_past_the_most_credit_a_tenant_may_hold_is_a_400(served: Served, metered_tier: str) -> None:
    """Issue 35, item 8: each top-up was bounded, their sum was not, and a sum past the micro-unit bound made
    the tenant's budget unreadable (a 503 for every request it made). The top-up that would cross it is
    refused, naming the field; the credit up to the bound stays usable."""
    tenant_id, key = new_tenant(served, metered_tier)
    for _ in range(10):  # 10 x the largest top-up: exactly the bound, 1,000,000,000
        assert top_up(served, tenant_id, "100000000").status_code == 201
    refused = top_up(served, tenant_id, "0.000001")
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error", "amount", "credit_out_of_range",
    )  # fmt: skip
    assert "1000000000.000000" in error["message"]
    with served.admin() as admin:
        shown = admin.get(f"/admin/tenants/{tenant_id}/credit")
    assert shown.status_code == 200, shown.text
    assert shown.json()["balance"] == "1000000000.000000" and len(shown.json()["entries"]) == 10
    time.sleep(served.services.settings.auth_cache_ttl_s * 2)
    assert chat(served, key, max_tokens=4).status_code == 200
    assert top_up(served, tenant_id, "-0.5", kind="adjustment").status_code == 201  # back within


def test_a_hold_outlives_a_silent_engine_through_http(served: Served, metered_tier: str) -> None:
    """Issue 35, item 5, through the route: the engine says nothing for several hold lives (its loop is
    busy, as under a long queue or prefill). The request's timer keeps its hold, so a second request that
    the balance cannot cover beside it is refused; once the first ends it settles exactly its usage row's
    cost. Before the timer, the silent request's hold lapsed, the second was admitted, and both settled."""
    tenant_id, key = new_tenant(served, metered_tier)
    top_up(served, tenant_id, "0.30")  # one hold of ~0.21 fits (100 output tokens at 0.002), two do not
    time.sleep(served.services.settings.auth_cache_ttl_s * 2)
    guard = served.services.budget_guard
    assert guard is not None
    kept_ttl, guard.hold_ttl_ms = guard.hold_ttl_ms, 600  # renewed every 0.2 s by the request's timer
    silence = threading.Event()
    stalled = served.engine.run_on_loop(lambda _: silence.wait(30))  # the engine's loop says nothing
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(chat, served, key, 100)
            wait_for(lambda: Decimal(limits(served, key).json()["budget"]["reserved"]) > 0)
            time.sleep(2.0)  # more than three hold lives with no output
            assert not first.done()
            second = chat(served, key, max_tokens=100)
            assert second.status_code == 429, second.text
            assert second.json()["error"]["code"] == "insufficient_quota"
            silence.set()
            reply = first.result(timeout=60)
    finally:
        silence.set()
        stalled.result(timeout=30)
        guard.hold_ttl_ms = kept_ttl
    assert reply.status_code == 200, reply.text
    spent = cost_of(reply.json())
    wait_for(lambda: costs(served, tenant_id) == [spent])
    shown = limits(served, key).json()["budget"]
    assert Decimal(shown["balance"]) == Decimal("0.30") - spent and shown["reserved"] == "0.000000"
