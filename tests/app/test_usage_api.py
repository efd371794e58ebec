"""The usage API against the live app: GET /v1/usage (a tenant's own usage only), GET /admin/usage,
GET /admin/tenants/{id}/bill; tier prices and Stripe customer ids in the admin API; their errors."""

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from billing.micros import to_micros
from billing.models import Adapter, StoredResponse, UsageEvent, UsageRollup
from billing.usage import hour_of, rollup_hours
from tests.app.conftest import MODEL, Served
from tests.app.helpers import unique, wait_for
from tests.app.test_budgets_api import PRICES as BUDGET_PRICES
from tests.app.test_budgets_api import chat, costs
from tests.billing.test_usage_queries import make_event

ERROR_KEYS = {"message", "type", "param", "code"}
T0 = datetime(2025, 4, 1, 10, 0, tzinfo=UTC)
PERIOD = {"start": "2025-04-01T10:00:00Z", "end": "2025-04-01T12:00:00Z"}
PRICE_FIELDS = (
    "price_input_per_mtok",
    "price_cached_input_per_mtok",
    "price_output_per_mtok",
    "price_gpu_per_second",
)


def assert_error(r: httpx.Response, status: int, *, param: str | None = None, code: str | None = None) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return str(body["error"]["message"])


@pytest.fixture(scope="module")
def admin(served: Served) -> Iterator[httpx.Client]:
    with served.admin() as client:
        yield client


class World:
    """Tenants a and b, each with a key and an adapter, and usage of both in [T0, T0 + 2h), rolled up."""

    def __init__(self, served: Served, admin: httpx.Client) -> None:
        prices = {
            "price_input_per_mtok": "0.15",
            "price_cached_input_per_mtok": 0.075,  # a JSON number is taken too
            "price_output_per_mtok": "0.6",
            "price_gpu_per_second": "0.000123",
        }
        tier = admin.post("/admin/tiers", json={"name": unique("metered"), **prices, "currency": "EUR"})
        assert tier.status_code == 201, tier.text
        self.tier = tier.json()
        self.a, self.a_key = served.new_tenant(unique("a"), tier=self.tier["name"])
        self.b, self.b_key = served.new_tenant(unique("b"), tier=self.tier["name"])
        self.url = served.url
        with served.services.session_factory() as s, s.begin():
            a_adapter, b_adapter = (
                Adapter(name="support", owner=self.a, base_model=MODEL),
                Adapter(name="b-secret", owner=self.b, base_model=MODEL),
            )
            s.add_all([a_adapter, b_adapter])
            s.flush()
            self.a_adapter, self.b_adapter = a_adapter.id, b_adapter.id
            s.add_all(
                [
                    make_event(self.a, T0, prompt_tokens=1_234_567, cached_tokens=0, completion_tokens=0,
                               gpu_ms=0.0),
                    make_event(self.a, T0 + timedelta(minutes=5), adapter_id=self.a_adapter,
                               prompt_tokens=100, cached_tokens=40, completion_tokens=1_000_000,
                               gpu_ms=2000.0),
                    make_event(self.a, T0 + timedelta(hours=1), prompt_tokens=10, cached_tokens=0,
                               completion_tokens=0, gpu_ms=0.0),
                    make_event(self.b, T0, adapter_id=self.b_adapter, prompt_tokens=777_777),
                    make_event(self.b, T0 + timedelta(hours=1, minutes=30), prompt_tokens=888_888),
                ]
            )  # fmt: skip
            s.flush()
            rollup_hours(s, start=T0, end=T0 + timedelta(hours=2))

    def as_tenant(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {key}"}, timeout=30)


@pytest.fixture(scope="module")
def world(served: Served, admin: httpx.Client) -> World:
    return World(served, admin)


# --- GET /v1/usage ---------------------------------------------------------------------------------------


def test_tenant_usage_by_adapter(world: World) -> None:
    with world.as_tenant(world.a_key) as client:
        r = client.get("/v1/usage", params={**PERIOD, "group_by": "adapter"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["object"], body["group_by"], body["start"], body["end"]) == (
        "list", "adapter", "2025-04-01T10:00:00Z", "2025-04-01T12:00:00Z",
    )  # fmt: skip
    rows = [
        (d["tenant_id"], d["base_model"], d["adapter"], d["adapter_id"], d["requests"], d["prompt_tokens"],
         d["cached_tokens"], d["completion_tokens"])
        for d in body["data"]
    ]  # fmt: skip
    assert rows == [
        (world.a, MODEL, "base", None, 2, 1_234_577, 0, 0),
        (world.a, MODEL, "support", world.a_adapter, 1, 100, 40, 1_000_000),
    ]
    assert body["data"][1]["gpu_ms"] == 2000.0 and body["data"][1]["hour"] is None


@pytest.mark.parametrize("group_by", ["hour", "adapter", "model", None])
def test_a_tenant_never_sees_another_tenants_usage(world: World, group_by: str | None) -> None:
    params = {**PERIOD, **({"group_by": group_by} if group_by else {})}  # default: hour
    for key, me, other in ((world.a_key, world.a, world.b), (world.b_key, world.b, world.a)):
        with world.as_tenant(key) as client:
            r = client.get("/v1/usage", params=params)
            assert r.status_code == 200, r.text
            # Trying to ask for the other tenant changes nothing: there is no such parameter for tenants.
            sneaky = client.get("/v1/usage", params={**params, "tenant_id": other})
        data = r.json()["data"]
        assert data and {d["tenant_id"] for d in data} == {me}
        assert sneaky.json()["data"] == data
        text = r.text
        assert other not in text and (
            world.b_adapter not in text if me == world.a else world.a_adapter not in text
        )
    with world.as_tenant(world.b_key) as client:
        totals = client.get("/v1/usage", params={**PERIOD, "group_by": "model"}).json()["data"]
    assert [(d["requests"], d["prompt_tokens"]) for d in totals] == [(2, 777_777 + 888_888)]


def test_tenant_usage_by_hour_is_live(served: Served, world: World) -> None:
    """An event in a later, never rolled-up hour shows at once."""
    later = T0 + timedelta(days=1)
    with served.services.session_factory() as s, s.begin():
        s.add(make_event(world.a, later + timedelta(minutes=7), prompt_tokens=42))
    with world.as_tenant(world.a_key) as client:
        r = client.get(
            "/v1/usage", params={"start": later.isoformat(), "end": (later + timedelta(hours=1)).isoformat()}
        )
    assert [(d["hour"], d["prompt_tokens"]) for d in r.json()["data"]] == [("2025-04-02T10:00:00Z", 42)]


def test_tenant_usage_by_batch_splits_batches_from_interactive(
    served: Served, admin: httpx.Client, world: World
) -> None:
    """group_by=batch: interactive requests in one row (batch_id null), then one row per batch, this
    tenant's own only; the admin view too."""
    day = T0 + timedelta(days=2)  # a period of its own: the world's other tests keep their totals
    batch = unique("batch_")
    with served.services.session_factory() as s, s.begin():
        s.add_all(
            [
                make_event(world.a, day, prompt_tokens=7, completion_tokens=1),
                make_event(world.a, day + timedelta(minutes=1), batch_id=batch, prompt_tokens=20,
                           completion_tokens=3),
                make_event(world.a, day + timedelta(minutes=2), batch_id=batch, prompt_tokens=30,
                           completion_tokens=4),
                make_event(world.b, day, batch_id=unique("batch_"), prompt_tokens=99),
            ]
        )  # fmt: skip
    period = {"start": day.isoformat(), "end": (day + timedelta(hours=1)).isoformat(), "group_by": "batch"}
    with world.as_tenant(world.a_key) as client:
        r = client.get("/v1/usage", params=period)
    assert r.status_code == 200, r.text
    assert r.json()["group_by"] == "batch"
    rows = [
        (d["tenant_id"], d["batch_id"], d["base_model"], d["requests"], d["prompt_tokens"],
         d["completion_tokens"])
        for d in r.json()["data"]
    ]  # fmt: skip
    assert rows == [(world.a, None, None, 1, 7, 1), (world.a, batch, None, 2, 50, 7)]
    across = admin.get("/admin/usage", params=period).json()["data"]
    assert {(d["tenant_id"], d["batch_id"] is None) for d in across} >= {
        (world.a, True), (world.a, False), (world.b, False)
    }  # fmt: skip
    with world.as_tenant(world.a_key) as client:
        by_model = client.get("/v1/usage", params={**period, "group_by": "model"}).json()["data"]
    assert [d["batch_id"] for d in by_model] == [None]  # other groupings do not split by batch


@pytest.mark.parametrize(
    ("params", "param", "words"),
    [
        ({"end": PERIOD["end"]}, "start", "start"),
        ({"start": PERIOD["start"]}, "end", "end"),
        ({"start": "yesterday", "end": PERIOD["end"]}, "start", "start"),
        ({"start": PERIOD["end"], "end": PERIOD["start"]}, "end", "end must be after start"),
        ({"start": PERIOD["start"], "end": PERIOD["start"]}, "end", "end must be after start"),
        ({"start": "2025-01-01T00:00:00Z", "end": "2025-04-04T00:00:01Z"}, "end", "at most 93 days"),
        ({**PERIOD, "group_by": "day"}, "group_by", "group_by"),
    ],
)
def test_tenant_usage_validation(world: World, params: dict[str, str], param: str, words: str) -> None:
    with world.as_tenant(world.a_key) as client:
        r = client.get("/v1/usage", params=params)
    assert words in assert_error(r, 400, param=param)


def test_tenant_usage_needs_a_key_and_takes_93_days(world: World) -> None:
    r = httpx.get(f"{world.url}/v1/usage", params=PERIOD)
    assert_error(r, 401, code="invalid_api_key")
    r = httpx.get(f"{world.url}/v1/usage", params=PERIOD, headers={"authorization": "Bearer sk-nope"})
    assert_error(r, 401, code="invalid_api_key")
    with world.as_tenant(world.a_key) as client:
        r = client.get("/v1/usage", params={"start": "2025-01-01", "end": "2025-04-04"})  # exactly 93 days
        assert r.status_code == 200, r.text
        assert r.json()["start"] == "2025-01-01T00:00:00Z"  # a date, without offset: UTC midnight
        assert_error(client.get("/admin/usage", params=PERIOD), 401, code="invalid_admin_key")


# --- GET /admin/usage ------------------------------------------------------------------------------------


def test_admin_usage_across_tenants_and_for_one(admin: httpx.Client, world: World) -> None:
    r = admin.get("/admin/usage", params={**PERIOD, "group_by": "model"})
    assert r.status_code == 200, r.text
    by_tenant = {d["tenant_id"]: (d["requests"], d["prompt_tokens"]) for d in r.json()["data"]}
    assert by_tenant[world.a] == (3, 1_234_677) and by_tenant[world.b] == (2, 1_666_665)
    one = admin.get("/admin/usage", params={**PERIOD, "group_by": "hour", "tenant_id": world.b}).json()
    assert [(d["tenant_id"], d["hour"], d["requests"]) for d in one["data"]] == [
        (world.b, "2025-04-01T10:00:00Z", 1),
        (world.b, "2025-04-01T11:00:00Z", 1),
    ]
    named = admin.get("/admin/usage", params={**PERIOD, "group_by": "adapter", "tenant_id": world.b}).json()
    assert [d["adapter"] for d in named["data"]] == ["base", "b-secret"]


def test_admin_usage_errors(admin: httpx.Client, served: Served) -> None:
    assert_error(
        admin.get("/admin/usage", params={**PERIOD, "tenant_id": "ten_missing"}), 404, param="tenant_id"
    )
    assert_error(admin.get("/admin/usage", params={"start": PERIOD["start"]}), 400, param="end")
    assert_error(admin.get("/admin/usage", params={**PERIOD, "group_by": "tenant"}), 400, param="group_by")
    assert_error(httpx.get(f"{served.url}/admin/usage", params=PERIOD), 401, code="invalid_admin_key")


# --- GET /admin/tenants/{id}/bill ------------------------------------------------------------------------


def test_bill_as_json_with_decimal_strings(admin: httpx.Client, world: World) -> None:
    r = admin.get(f"/admin/tenants/{world.a}/bill", params=PERIOD)
    assert r.status_code == 200, r.text
    bill = r.json()
    assert (bill["object"], bill["tenant_id"], bill["currency"]) == ("bill", world.a, "eur")
    assert bill["prices"] == {
        "tier": world.tier["name"], "currency": "eur", "input_per_mtok": "0.150000",
        "cached_input_per_mtok": "0.075000", "output_per_mtok": "0.600000", "gpu_per_second": "0.000123",
        "storage_per_gb_day": "0.000000",
    }  # fmt: skip
    base, support = bill["lines"]
    # base: 1,234,577 input tokens x 0.15 / 1M = 0.18518655 -> 0.185187 (half even)
    assert base == {
        "base_model": MODEL, "adapter_id": None, "adapter": "base", "currency": "eur", "requests": 2,
        "input_tokens": 1_234_577, "cached_input_tokens": 0, "output_tokens": 0, "gpu_seconds": "0.000000",
        "input_cost": "0.185187", "cached_input_cost": "0.000000", "output_cost": "0.000000",
        "gpu_cost": "0.000000", "storage_cost": "0.000000", "adjustment": "0.000000", "total": "0.185187",
    }  # fmt: skip
    # support: input 60 -> 0.000009; cached 40 -> 0.000003; output 1M x 0.6 = 0.6; 2 s x 0.000123
    assert (support["adapter"], support["adapter_id"], support["gpu_seconds"]) == (
        "support",
        world.a_adapter,
        "2.000000",
    )
    assert [support[k] for k in ("input_cost", "cached_input_cost", "output_cost", "gpu_cost", "total")] == [
        "0.000009", "0.000003", "0.600000", "0.000246", "0.600258",
    ]  # fmt: skip
    totals = bill["totals"]
    assert (totals["requests"], totals["input_tokens"], totals["total"]) == (3, 1_234_637, "0.785445")
    assert all(isinstance(totals[k], str) for k in ("gpu_seconds", "input_cost", "total"))


def test_bill_isolated_per_tenant_and_its_errors(admin: httpx.Client, world: World) -> None:
    b_bill = admin.get(f"/admin/tenants/{world.b}/bill", params=PERIOD).json()
    assert [line["adapter"] for line in b_bill["lines"]] == ["base", "b-secret"]
    assert b_bill["totals"]["input_tokens"] == 777_777 - 0 + 888_888
    assert_error(admin.get("/admin/tenants/ten_missing/bill", params=PERIOD), 404, code="not_found")
    bad = {"start": "2025-04-01T10:30:00Z", "end": PERIOD["end"]}
    assert "whole UTC hour" in assert_error(
        admin.get(f"/admin/tenants/{world.a}/bill", params=bad), 400, param="start"
    )
    backwards = {"start": PERIOD["end"], "end": PERIOD["start"]}
    assert_error(admin.get(f"/admin/tenants/{world.a}/bill", params=backwards), 400, param="end")
    assert_error(
        admin.get(f"/admin/tenants/{world.a}/bill", params={"start": PERIOD["start"]}), 400, param="end"
    )
    with world.as_tenant(world.a_key) as client:
        assert_error(
            client.get(f"/admin/tenants/{world.a}/bill", params=PERIOD), 401, code="invalid_admin_key"
        )


# --- prices and Stripe customers in the admin API --------------------------------------------------------


def test_tier_prices_are_decimal_strings(admin: httpx.Client) -> None:
    name = unique("priced")
    created = admin.post(
        "/admin/tiers", json={"name": name, "price_input_per_mtok": "0.15", "price_output_per_mtok": 2}
    )
    assert created.status_code == 201, created.text
    tier = created.json()
    assert [tier[f] for f in PRICE_FIELDS] == ["0.150000", "0.000000", "2.000000", "0.000000"]
    assert tier["currency"] == "usd"
    assert admin.get(f"/admin/tiers/{name}").json() == tier
    patched = admin.patch(
        f"/admin/tiers/{name}", json={"price_gpu_per_second": "0.000001", "currency": "Gbp"}
    )
    assert patched.status_code == 200, patched.text
    assert [patched.json()[f] for f in PRICE_FIELDS] == ["0.150000", "0.000000", "2.000000", "0.000001"]
    assert patched.json()["currency"] == "gbp"
    listed = {t["name"]: t for t in admin.get("/admin/tiers").json()["data"]}
    assert (
        listed[name]["price_gpu_per_second"] == "0.000001"
        and listed["free"]["price_input_per_mtok"] == "0.000000"
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"price_input_per_mtok": "-0.01"}, "price_input_per_mtok"),
        ({"price_cached_input_per_mtok": "0.0000001"}, "price_cached_input_per_mtok"),
        ({"price_output_per_mtok": "1000000000"}, "price_output_per_mtok"),
        ({"price_output_per_mtok": None}, "price_output_per_mtok"),
        ({"price_gpu_per_second": "NaN"}, "price_gpu_per_second"),
        ({"price_gpu_per_second": "cheap"}, "price_gpu_per_second"),
        ({"currency": "us"}, "currency"),
        ({"currency": None}, "currency"),
    ],
)
def test_bad_prices_are_400_naming_the_field(admin: httpx.Client, body: dict[str, Any], param: str) -> None:
    name = unique("bad")
    assert_error(admin.post("/admin/tiers", json={"name": name, **body}), 400, param=param)
    assert admin.post("/admin/tiers", json={"name": name, "price_input_per_mtok": "1"}).status_code == 201
    assert_error(admin.patch(f"/admin/tiers/{name}", json={"rpm": 5, **body}), 400, param=param)
    unchanged = admin.get(f"/admin/tiers/{name}").json()
    assert (unchanged["rpm"], unchanged["price_input_per_mtok"]) == (None, "1.000000")


def test_stripe_customer_on_tenants(admin: httpx.Client, served: Served) -> None:
    tenant_id, _ = served.new_tenant(unique("stripe"))
    assert admin.get(f"/admin/tenants/{tenant_id}").json()["stripe_customer_id"] is None
    r = admin.patch(f"/admin/tenants/{tenant_id}", json={"stripe_customer_id": "cus_T3st"})
    assert r.status_code == 200, r.text
    assert r.json()["stripe_customer_id"] == "cus_T3st"
    renamed = admin.patch(f"/admin/tenants/{tenant_id}", json={"name": unique("renamed")}).json()
    assert renamed["stripe_customer_id"] == "cus_T3st"  # absent: left as it is
    listed = {t["id"]: t for t in admin.get("/admin/tenants").json()["data"]}
    assert listed[tenant_id]["stripe_customer_id"] == "cus_T3st"
    for bad in ("cust_1", "cus_", "sk_live_x", 12):
        r = admin.patch(f"/admin/tenants/{tenant_id}", json={"stripe_customer_id": bad, "rpm": 7})
        assert_error(r, 400, param="stripe_customer_id")
    kept = admin.get(f"/admin/tenants/{tenant_id}").json()
    assert (kept["stripe_customer_id"], kept["rpm"]) == ("cus_T3st", None)
    cleared = admin.patch(f"/admin/tenants/{tenant_id}", json={"stripe_customer_id": None})
    assert cleared.json()["stripe_customer_id"] is None


# --- rollups keep currencies apart -----------------------------------------------------------------------


def rollups_of(served: Served, tenant_id: str) -> list[UsageRollup]:
    with served.services.session_factory() as s:
        return list(s.scalars(select(UsageRollup).where(UsageRollup.tenant_id == tenant_id)))


def event_hours(served: Served, tenant_id: str) -> dict[tuple[datetime, str], Decimal]:
    """(hour, currency) -> the settled costs of the tenant's usage rows."""
    sums: dict[tuple[datetime, str], Decimal] = {}
    with served.services.session_factory() as s:
        for row in s.scalars(select(UsageEvent).where(UsageEvent.tenant_id == tenant_id)):
            assert row.cost is not None and row.currency is not None
            key = (hour_of(row.started_at), row.currency)
            sums[key] = sums.get(key, Decimal(0)) + Decimal(str(row.cost))
    return sums


def test_a_postpaid_tenants_currency_change_keeps_each_currency_in_its_own_rollup(
    served: Served, admin: httpx.Client
) -> None:
    """Issue 35, item 8: a postpaid tenant's tier may change currency; its usage in that hour was summed
    into one rollup, usd and eur added together, and exported as one amount. Each currency is its own."""
    tier = unique("currency")
    assert admin.post("/admin/tiers", json={"name": tier, **BUDGET_PRICES}).status_code == 201
    tenant_id, key = served.new_tenant(unique("c"), tier=tier)
    assert chat(served, key, max_tokens=3).status_code == 200
    wait_for(lambda: len(costs(served, tenant_id)) == 1)
    assert admin.patch(f"/admin/tiers/{tier}", json={"currency": "eur"}).status_code == 200
    time.sleep(served.services.settings.auth_cache_ttl_s * 2)  # the price cache's TTL
    assert chat(served, key, max_tokens=3).status_code == 200
    wait_for(lambda: len(costs(served, tenant_id)) == 2)
    settled = event_hours(served, tenant_id)
    assert {currency for _, currency in settled} == {"usd", "eur"}
    hours = sorted(hour for hour, _ in settled)
    with served.services.session_factory() as s, s.begin():
        rollup_hours(s, start=hours[0], end=hours[-1] + timedelta(hours=1))
    rollups = rollups_of(served, tenant_id)
    assert [(r.hour, r.cost_micros) for r in rollups if len(settled) > len(rollups)] == []  # none mixed
    rolled = {(r.hour, r.currency): r.cost_micros for r in rollups}
    assert rolled == {key: to_micros(cost) for key, cost in settled.items()}


def test_tenant_usage_shows_its_stored_bytes_against_its_tiers_quota(
    served: Served, admin: httpx.Client
) -> None:
    """Issue 35: storage in GET /v1/usage: the tenant's live stored responses' bytes (what the quota reads),
    the tier's quota; another tenant's stored responses are not in it, and /admin/usage has none."""
    tier = admin.post("/admin/tiers", json={"name": unique("stored"), "max_stored_response_bytes": 1_000_000})
    assert tier.status_code == 201, tier.text
    a, a_key = served.new_tenant(unique("a"), tier=tier.json()["name"])
    _, b_key = served.new_tenant(unique("b"))
    headers = {"authorization": f"Bearer {a_key}"}
    for _ in range(2):
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
        assert (
            httpx.post(f"{served.url}/v1/responses", headers=headers, json=body, timeout=60).status_code
            == 200
        )
    with served.services.session_factory() as s:
        stored = sum(s.scalars(select(StoredResponse.size_bytes).where(StoredResponse.tenant_id == a)))
    assert stored > 0
    r = httpx.get(f"{served.url}/v1/usage", headers=headers, params=PERIOD)
    assert r.status_code == 200, r.text
    assert r.json()["storage"] == {
        "object": "usage.storage",
        "stored_response_bytes": stored,
        "file_bytes": 0,
        "max_stored_response_bytes": 1_000_000,
    }
    r = httpx.get(f"{served.url}/v1/usage", headers={"authorization": f"Bearer {b_key}"}, params=PERIOD)
    assert r.json()["storage"]["stored_response_bytes"] == 0
    assert admin.get("/admin/usage", params=PERIOD).json()["storage"] is None
