"""Storage priced by the tier (issue 35, item 1): each tenant's stored responses and files charged once an
hour at its tier's `price_storage_per_gb_day`, as a usage row with a fixed cost: on each database, and
through the admin API, a real upload, the tenant's own usage API and its bill."""

import uuid
from datetime import timedelta
from decimal import Decimal
from typing import Any

import httpx
from openai import OpenAI
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from app.budgets.guard import BudgetGuard
from app.budgets.local_backend import LocalBudgets
from app.responses.store import ResponseStore
from app.settings import ResponsesConfig
from app.storage_billing import MODEL, StorageBilling, storage_request_id
from billing import credit
from billing import repository as repo
from billing.micros import to_micros
from billing.models import UsageEvent, utcnow
from billing.usage import hour_of, rollup_hours
from tests.app.conftest import Served
from tests.app.test_files_api import jsonl, line


def response_row(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "model": "m", "previous_response_id": None, "output": []}


def test_each_tenants_stored_bytes_are_charged_once_an_hour(session_factory: sessionmaker[Session]) -> None:
    """A tenant of a priced tier pays bytes x price / 24 / 10^9 for the hour that ended, once however often
    the charge runs (every ingress runs it); an unpriced tier's tenant and a disabled one pay nothing."""
    suffix = uuid.uuid4().hex[:8]
    with session_factory() as s, s.begin():
        repo.create_tier(s, name=f"priced-{suffix}", price_storage_per_gb_day="24", currency="eur")
        repo.create_tier(s, name=f"unpriced-{suffix}")
        payer = repo.create_tenant(s, name=f"payer-{suffix}", tier=f"priced-{suffix}").id
        free = repo.create_tenant(s, name=f"free-{suffix}", tier=f"unpriced-{suffix}").id
        gone = repo.create_tenant(s, name=f"gone-{suffix}", tier=f"priced-{suffix}").id
    store = ResponseStore(session_factory, ResponsesConfig())
    bulk = [{"role": "user", "content": "x" * 500_000}]
    for tenant_id in (payer, free, gone):
        store.save(tenant_id, response_row(f"resp_{tenant_id}"), bulk, bulk)
    with session_factory() as s, s.begin():
        repo.disable_tenant(s, tenant_id=gone)
    size = store.stored_bytes(payer)
    assert size > 1_000_000
    billing = StorageBilling(session_factory)
    now = utcnow()
    assert billing.charge(now) >= 1
    # Later in the same hour (5 minutes on, but never past the hour: a run at 15:57 once crossed into 16:02)
    later = min(now + timedelta(minutes=5), hour_of(now) + timedelta(minutes=59, seconds=59))
    assert billing.charge(now) == 0 and billing.charge(later) == 0  # charged once
    assert StorageBilling(session_factory).charge(now) == 0  # another replica's run inserts nothing
    hour = hour_of(now) - timedelta(hours=1)
    with session_factory() as s:
        rows = s.scalars(select(UsageEvent).where(UsageEvent.tenant_id.in_([payer, free, gone]))).all()
    assert [(r.tenant_id, r.request_id) for r in rows] == [(payer, storage_request_id(payer, hour))]
    row = rows[0]
    assert row.cost == (Decimal(size) * 24 / 24 / 10**9).quantize(Decimal("0.000001"))
    assert (row.currency, row.model, row.prompt_tokens, row.completion_tokens) == ("eur", MODEL, 0, 0)
    assert (hour_of(row.started_at), row.finished_at - row.started_at) == (hour, timedelta(hours=1))
    assert billing.charge(now + timedelta(hours=1)) >= 1  # the next hour is charged in its turn


def test_a_tier_priced_through_the_admin_api_charges_an_uploaded_file(served: Served) -> None:
    """The admin prices a tier's storage; its tenant uploads a file with the OpenAI SDK; the hour's charge
    is in the tenant's own GET /v1/usage (base model `storage`, no tokens, no request) and on its bill at
    its cost, as the line's storage part, with the storage price among the bill's prices."""
    name = f"stored-{uuid.uuid4().hex[:8]}"
    with served.admin() as admin:
        tier = admin.post("/admin/tiers", json={"name": name, "price_storage_per_gb_day": "1000"})
        assert tier.status_code == 201, tier.text
        assert tier.json()["price_storage_per_gb_day"] == "1000.000000"
        refused = admin.patch(f"/admin/tiers/{name}", json={"price_storage_per_gb_day": "-1"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "price_storage_per_gb_day"
    tenant_id, key = served.new_tenant(name, tier=name)
    client = OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0)
    uploaded = client.files.create(
        file=("in.jsonl", jsonl([line(f"l{i}") for i in range(40)])), purpose="batch"
    )
    now = utcnow()
    assert StorageBilling(served.services.session_factory).charge(now) >= 1
    hour = hour_of(now) - timedelta(hours=1)
    period = {"start": hour.isoformat(), "end": (hour + timedelta(hours=1)).isoformat()}
    usage = httpx.get(
        f"{served.url}/v1/usage",
        params={**period, "group_by": "model"},
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert usage.status_code == 200, usage.text
    (storage,) = [d for d in usage.json()["data"] if d["base_model"] == MODEL]
    assert (storage["requests"], storage["prompt_tokens"], storage["completion_tokens"]) == (0, 0, 0)
    with served.services.session_factory() as s, s.begin():
        rollup_hours(s, start=hour, end=hour + timedelta(hours=1))
    with served.admin() as admin:
        bill = admin.get(f"/admin/tenants/{tenant_id}/bill", params=period)
    assert bill.status_code == 200, bill.text
    (charged,) = [line for line in bill.json()["lines"] if line["base_model"] == MODEL]
    want = (Decimal(uploaded.bytes) * 1000 / 24 / 10**9).quantize(Decimal("0.000001"))
    assert Decimal(charged["total"]) == Decimal(charged["storage_cost"]) == want > 0
    assert Decimal(charged["adjustment"]) == 0 and charged["requests"] == 0
    assert Decimal(bill.json()["totals"]["storage_cost"]) == want
    assert Decimal(bill.json()["prices"]["storage_per_gb_day"]) == 1000


async def test_an_hours_charge_is_spent_from_a_prepaid_balance_at_once(
    session_factory: sessionmaker[Session],
) -> None:
    """Before, a prepaid tenant's live balance learned of its storage charges only when its budget state
    was next loaded (a restarted backend): until then it could spend the same money on requests. The run
    that inserts the charge settles it in the live budget, once, however many replicas run it."""
    suffix = uuid.uuid4().hex[:8]
    with session_factory() as s, s.begin():
        repo.create_tier(s, name=f"prepaid-{suffix}", price_storage_per_gb_day="240")
        payer = repo.create_tenant(s, name=f"payer-{suffix}", tier=f"prepaid-{suffix}").id
        credit.add_credit(s, tenant_id=payer, amount="50", kind="topup", reason="t", actor="t")
    store = ResponseStore(session_factory, ResponsesConfig())
    bulk = [{"role": "user", "content": "x" * 500_000}]
    store.save(payer, response_row(f"resp_{payer}"), bulk, bulk)
    guard = BudgetGuard(LocalBudgets(), session_factory, price_ttl_s=0)
    before = await guard.view(payer)
    assert before is not None and before.balance == to_micros(Decimal(50))
    now = utcnow()
    replicas = [StorageBilling(session_factory, spend=guard.spend) for _ in range(2)]
    assert [await run_in_threadpool(r.charge, now) for r in replicas] == [1, 0]
    with session_factory() as s:
        cost = s.scalar(select(UsageEvent.cost).where(UsageEvent.tenant_id == payer))
    assert cost is not None and cost > 0
    after = await guard.view(payer)
    assert after is not None and after.balance == to_micros(Decimal(50) - cost)
    assert after.spent_day == to_micros(cost)
