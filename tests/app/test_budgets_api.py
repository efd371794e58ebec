"""Budgets and credit through the real HTTP API (issue 29): top-up, reserve, settle, refuse with 429
insufficient_quota before any work, spend limits hard and soft, the surfaces (GET /v1/limits, admin
credit and budgets), every usage row priced, and budgets failing closed when their state is away."""

import json
import time
import uuid
from collections.abc import Callable
from decimal import Decimal

import httpx
import pytest
from sqlalchemy import func, select
from typer.testing import Result

from app.budgets.local_backend import LocalBudgets
from app.budgets.redis_backend import RedisBudgets
from billing import credit
from billing.models import UsageEvent, utcnow
from tests.app.conftest import MODEL, Served
from tests.app.helpers import wait_for

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
