"""The admin API for rate limits: tiers (create, list, get, partial update, null = unlimited) and tenants'
overrides (null clears one), their errors, and their effect on a tenant's requests within seconds."""

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.app.conftest import ADMIN_KEY, MODEL, Served
from tests.app.helpers import unique

ERROR_KEYS = {"message", "type", "param", "code"}
TIER_FIELDS = {
    "name",
    "batch_price_factor",
    "object",
    "description",
    "rpm",
    "tpm",
    "max_concurrent",
    "max_tokens_cap",
    "on_limit",
    "max_queue_ms",
    "created_at",
}
LIMITS = ("rpm", "tpm", "max_concurrent", "max_tokens_cap")
TENANT_FIELDS = {"id", "object", "name", "tier", "status", "created_at", "updated_at", "disabled_at"}
TENANT_FIELDS |= {*LIMITS, "limits", "stripe_customer_id"}
TIER_FIELDS |= {
    *("price_input_per_mtok", "price_cached_input_per_mtok", "price_output_per_mtok"),
    *("price_gpu_per_second", "currency", "weight", "max_stored_response_bytes", "price_storage_per_gb_day"),
}
LIMITS_FIELDS = {*LIMITS, "on_limit", "max_queue_ms"}
FREE = {"rpm": 60, "tpm": 100_000, "max_concurrent": 8, "max_tokens_cap": 4096, "on_limit": "reject"}
CACHE_WAIT_S = 0.3  # the fixture's auth cache lives 0.2 s


def assert_error(
    r: httpx.Response, status: int, *, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == ERROR_KEYS, body
    if code is not None:
        assert body["error"]["code"] == code, body
    if param is not None:
        assert body["error"]["param"] == param, body
    return dict(body["error"])


@pytest.fixture(scope="module")
def admin(served: Served) -> Iterator[httpx.Client]:
    with served.admin() as client:
        yield client


@pytest.fixture
def tier(admin: httpx.Client) -> dict[str, Any]:
    body = {"name": unique("gold"), "description": "Paid", "rpm": 100, "tpm": 10_000, "max_concurrent": 4}
    r = admin.post("/admin/tiers", json=body)
    assert r.status_code == 201, r.text
    return dict(r.json())


def chat(served: Served, key: str) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    return httpx.post(
        f"{served.url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30
    )


# -- tiers -------------------------------------------------------------------------------------------------


def test_seeded_tiers_are_listed_with_their_limits(admin: httpx.Client) -> None:
    r = admin.get("/admin/tiers")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list"
    assert all(set(t) == TIER_FIELDS and t["object"] == "tier" for t in body["data"])
    names = [t["name"] for t in body["data"]]
    assert names == sorted(names)
    by_name = {t["name"]: t for t in body["data"]}
    assert {k: by_name["free"][k] for k in FREE} == FREE
    assert (by_name["pro"]["on_limit"], by_name["pro"]["max_queue_ms"]) == ("queue", 5000)
    assert [by_name["enterprise"][k] for k in LIMITS] == [None] * 4


def test_create_and_get_tier(admin: httpx.Client) -> None:
    body = {
        "name": unique("gold"),
        "description": "Paid",
        "rpm": 120,
        "tpm": 5_000_000_000,
        "max_concurrent": 16,
        "max_tokens_cap": 2048,
        "on_limit": "queue",
        "max_queue_ms": 1500,
        "weight": 2.5,
    }
    r = admin.post("/admin/tiers", json=body)
    assert r.status_code == 201, r.text
    created = r.json()
    assert set(created) == TIER_FIELDS
    assert {k: created[k] for k in body} == body
    assert admin.get(f"/admin/tiers/{body['name']}").json() == created
    assert created in admin.get("/admin/tiers").json()["data"]


def test_a_new_tier_is_unlimited_unless_told(admin: httpx.Client) -> None:
    r = admin.post("/admin/tiers", json={"name": unique("open")})
    assert r.status_code == 201, r.text
    tier = r.json()
    assert [tier[k] for k in LIMITS] == [None] * 4
    assert (tier["on_limit"], tier["max_queue_ms"], tier["description"]) == ("reject", 0, "")
    assert tier["weight"] == 1.0  # an equal share unless told


def test_duplicate_tier_is_409(admin: httpx.Client, tier: dict[str, Any]) -> None:
    r = admin.post("/admin/tiers", json={"name": tier["name"], "rpm": 1})
    error = assert_error(r, 409, code="conflict", param="name")
    assert tier["name"] in error["message"]
    assert admin.get(f"/admin/tiers/{tier['name']}").json() == tier


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"rpm": 0}, "rpm", None),
        ({"tpm": -5}, "tpm", None),
        ({"max_concurrent": "4"}, "max_concurrent", None),
        ({"max_tokens_cap": 1.5}, "max_tokens_cap", None),
        ({"rpm": True}, "rpm", None),
        ({"rpm": 2**31}, "rpm", None),
        ({"on_limit": "drop"}, "on_limit", None),
        ({"max_queue_ms": 60_001}, "max_queue_ms", None),
        ({"on_limit": "queue"}, "max_queue_ms", "invalid_limits"),  # queueing for 0 ms
        ({"burst": 10}, "burst", None),
        ({"weight": 0}, "weight", None),
        ({"weight": -1}, "weight", None),
        ({"weight": 1000.5}, "weight", None),
        ({"weight": "2"}, "weight", None),
        ({"weight": None}, "weight", None),
    ],
)
def test_invalid_tier_bodies_are_400_naming_the_field(
    admin: httpx.Client, body: dict[str, Any], param: str, code: str | None
) -> None:
    name = unique("bad")
    assert_error(admin.post("/admin/tiers", json={"name": name, **body}), 400, param=param, code=code)
    assert_error(admin.get(f"/admin/tiers/{name}"), 404)


@pytest.mark.parametrize("name", ["", "a/b", "x" * 65, " gold", None])
def test_invalid_tier_names_are_400(admin: httpx.Client, name: str | None) -> None:
    assert_error(admin.post("/admin/tiers", json={"name": name}), 400, param="name")


def test_patch_changes_only_the_fields_given(admin: httpx.Client, tier: dict[str, Any]) -> None:
    path = f"/admin/tiers/{tier['name']}"
    r = admin.patch(path, json={"rpm": 5})
    assert r.status_code == 200, r.text
    assert r.json() == {**tier, "rpm": 5}
    r = admin.patch(path, json={"tpm": None, "max_tokens_cap": 64, "description": "Cheaper"})
    assert r.json() == {**tier, "rpm": 5, "tpm": None, "max_tokens_cap": 64, "description": "Cheaper"}
    r = admin.patch(path, json={"on_limit": "queue", "max_queue_ms": 250})
    assert (r.json()["on_limit"], r.json()["max_queue_ms"]) == ("queue", 250)
    r = admin.patch(path, json={"weight": 3})
    assert (r.json()["weight"], r.json()["max_queue_ms"]) == (3.0, 250)
    assert admin.get(path).json() == r.json()


def test_null_makes_every_limit_unlimited(admin: httpx.Client, tier: dict[str, Any]) -> None:
    r = admin.patch(f"/admin/tiers/{tier['name']}", json=dict.fromkeys(LIMITS))
    assert r.status_code == 200, r.text
    assert [r.json()[k] for k in LIMITS] == [None] * 4


def test_empty_patch_changes_nothing(admin: httpx.Client, tier: dict[str, Any]) -> None:
    r = admin.patch(f"/admin/tiers/{tier['name']}", json={})
    assert r.status_code == 200, r.text
    assert r.json() == tier


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"rpm": 0}, "rpm", None),
        ({"description": None}, "description", None),  # only limits may be null
        ({"on_limit": None}, "on_limit", None),
        ({"max_queue_ms": None}, "max_queue_ms", None),
        ({"weight": None}, "weight", None),
        ({"weight": 0.0}, "weight", None),
        ({"on_limit": "queue"}, "max_queue_ms", "invalid_limits"),  # the tier queues for 0 ms
        ({"rpm": 10, "on_limit": "queue", "max_queue_ms": 0}, "max_queue_ms", "invalid_limits"),
        ({"name": "renamed"}, "name", None),  # tiers are not renamed here
    ],
)
def test_invalid_patches_are_400_and_change_nothing(
    admin: httpx.Client, tier: dict[str, Any], body: dict[str, Any], param: str, code: str | None
) -> None:
    error = assert_error(admin.patch(f"/admin/tiers/{tier['name']}", json=body), 400, param=param, code=code)
    assert param in error["message"]
    assert admin.get(f"/admin/tiers/{tier['name']}").json() == tier


@pytest.mark.parametrize(("method", "body"), [("GET", None), ("PATCH", {"rpm": 1})])
def test_unknown_tier_is_404(admin: httpx.Client, method: str, body: dict[str, Any] | None) -> None:
    error = assert_error(admin.request(method, "/admin/tiers/platinum", json=body), 404, code="not_found")
    assert "platinum" in error["message"]


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/admin/tiers", None),
        ("POST", "/admin/tiers", {"name": "sneaky", "rpm": 1}),
        ("POST", "/admin/tiers", {"rpm": "not even valid"}),  # credentials are checked before the body
        ("GET", "/admin/tiers/free", None),
        ("PATCH", "/admin/tiers/free", {"rpm": None}),
        ("PATCH", "/admin/tenants/ten_aaaaaaaaaaaaaaaaaaaa", {"rpm": 1}),
    ],
)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", f"Basic {ADMIN_KEY}"])
def test_tier_routes_need_the_admin_key(
    served: Served,
    admin: httpx.Client,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    authorization: str | None,
) -> None:
    headers = {"authorization": authorization} if authorization else {}
    r = httpx.request(method, f"{served.url}{path}", json=body, headers=headers)
    assert_error(r, 401, code="invalid_admin_key")
    assert admin.get("/admin/tiers/free").json()["rpm"] == 60
    assert_error(admin.get("/admin/tiers/sneaky"), 404)


# -- tenants' overrides ------------------------------------------------------------------------------------


@pytest.fixture
def tenant(admin: httpx.Client) -> dict[str, Any]:
    r = admin.post("/admin/tenants", json={"name": unique("t")})
    assert r.status_code == 201, r.text
    return dict(r.json())


def test_a_tenant_shows_no_overrides_and_its_tiers_limits(tenant: dict[str, Any]) -> None:
    assert set(tenant) == TENANT_FIELDS
    assert [tenant[k] for k in LIMITS] == [None] * 4
    assert set(tenant["limits"]) == LIMITS_FIELDS
    assert tenant["limits"] == {**FREE, "max_queue_ms": 0}


def test_overrides_are_set_shown_and_cleared(admin: httpx.Client, tenant: dict[str, Any]) -> None:
    path = f"/admin/tenants/{tenant['id']}"
    r = admin.patch(path, json={"rpm": 2, "max_tokens_cap": 16})
    assert r.status_code == 200, r.text
    updated = r.json()
    assert (updated["rpm"], updated["tpm"], updated["max_tokens_cap"]) == (2, None, 16)
    assert updated["limits"] == {**FREE, "rpm": 2, "max_tokens_cap": 16, "max_queue_ms": 0}
    assert (updated["name"], updated["tier"]) == (tenant["name"], "free")
    assert admin.get(path).json() == updated
    assert updated in admin.get("/admin/tenants").json()["data"]

    cleared = admin.patch(path, json={"rpm": None}).json()  # null clears; the other override stays
    assert (cleared["rpm"], cleared["max_tokens_cap"]) == (None, 16)
    assert cleared["limits"]["rpm"] == 60
    assert admin.patch(path, json={}).json() == cleared


def test_overrides_with_rename_and_tier_move_at_once(admin: httpx.Client, tenant: dict[str, Any]) -> None:
    tier = admin.post("/admin/tiers", json={"name": unique("gold"), "tpm": 999, "on_limit": "queue",
                                            "max_queue_ms": 100}).json()  # fmt: skip
    name = unique("moved")
    r = admin.patch(f"/admin/tenants/{tenant['id']}", json={"name": name, "tier": tier["name"], "rpm": 7})
    assert r.status_code == 200, r.text
    limits = r.json()["limits"]
    assert (r.json()["name"], r.json()["tier"]) == (name, tier["name"])
    assert limits == {"rpm": 7, "tpm": 999, "max_concurrent": None, "max_tokens_cap": None,
                      "on_limit": "queue", "max_queue_ms": 100}  # fmt: skip


def test_a_tenant_follows_its_tiers_changes(admin: httpx.Client, tier: dict[str, Any]) -> None:
    tenant = admin.post("/admin/tenants", json={"name": unique("t"), "tier": tier["name"]}).json()
    admin.patch(f"/admin/tenants/{tenant['id']}", json={"max_concurrent": 1})
    admin.patch(f"/admin/tiers/{tier['name']}", json={"rpm": None, "max_concurrent": 50})
    limits = admin.get(f"/admin/tenants/{tenant['id']}").json()["limits"]
    assert (limits["rpm"], limits["tpm"], limits["max_concurrent"]) == (None, 10_000, 1)  # override wins


@pytest.mark.parametrize(
    "body",
    [{"rpm": 0}, {"tpm": "many"}, {"max_concurrent": -1}, {"max_tokens_cap": 2.5}, {"name": "x", "rpm": 0}],
)
def test_invalid_overrides_are_400_and_change_nothing(
    admin: httpx.Client, tenant: dict[str, Any], body: dict[str, Any]
) -> None:
    param = next(k for k in body if k in LIMITS)
    error = assert_error(admin.patch(f"/admin/tenants/{tenant['id']}", json=body), 400, param=param)
    assert param in error["message"]
    assert admin.get(f"/admin/tenants/{tenant['id']}").json() == tenant


def test_overrides_of_an_unknown_tenant_are_404(admin: httpx.Client) -> None:
    assert_error(
        admin.patch("/admin/tenants/ten_aaaaaaaaaaaaaaaaaaaa", json={"rpm": 1}), 404, code="not_found"
    )


def test_on_limit_is_the_tiers_not_a_tenants(admin: httpx.Client, tenant: dict[str, Any]) -> None:
    r = admin.patch(f"/admin/tenants/{tenant['id']}", json={"on_limit": "queue"})
    assert_error(r, 400, param="on_limit")


# -- effect on requests ------------------------------------------------------------------------------------


def test_an_rpm_override_limits_the_tenants_requests_within_seconds(
    served: Served, admin: httpx.Client
) -> None:
    tenant_id, key = served.new_tenant(unique("limited"))
    r = admin.patch(f"/admin/tenants/{tenant_id}", json={"rpm": 2})
    assert r.status_code == 200, r.text
    time.sleep(CACHE_WAIT_S)

    first, second, third = (chat(served, key) for _ in range(3))
    assert (first.status_code, second.status_code, third.status_code) == (200, 200, 429), third.text
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    error = assert_error(third, 429, code="rate_limit_exceeded")
    assert "limit 2" in error["message"]
    assert int(third.headers["retry-after"]) >= 1
    assert int(third.headers["retry-after-ms"]) > 0

    admin.patch(f"/admin/tenants/{tenant_id}", json={"rpm": None})  # back to the tier's 60 rpm
    time.sleep(CACHE_WAIT_S)
    again = chat(served, key)
    assert again.status_code == 200, again.text
    assert again.headers["x-ratelimit-limit-requests"] == "60"


def test_a_tier_limit_applies_to_its_tenants_and_null_lifts_it(served: Served, admin: httpx.Client) -> None:
    tier = admin.post("/admin/tiers", json={"name": unique("tight"), "rpm": 1}).json()
    _, key = served.new_tenant(unique("tight"), tier=tier["name"])
    assert chat(served, key).status_code == 200
    assert_error(chat(served, key), 429, code="rate_limit_exceeded")

    admin.patch(f"/admin/tiers/{tier['name']}", json={"rpm": None})
    time.sleep(CACHE_WAIT_S)
    lifted = chat(served, key)
    assert lifted.status_code == 200, lifted.text
    assert "x-ratelimit-limit-requests" not in lifted.headers  # unlimited: no rate-limit headers


def test_a_tiers_weight_divides_its_tenants_service_in_the_engine(
    served: Served, admin: httpx.Client
) -> None:
    # The same request from tenants on tiers of weight 1 and 4: the engine's fair order counts a quarter of
    # the service for the second (its share is four times the first's while both wait).
    counters = {}
    for weight in (1, 4):
        tier = admin.post("/admin/tiers", json={"name": unique("share"), "weight": weight}).json()
        tenant_id, key = served.new_tenant(unique("share"), tier=tier["name"])
        body = {
            "model": MODEL,
            "prompt": "the same words",
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(f"{served.url}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        counters[weight] = served.engine.stats().tenant_service[tenant_id]
    assert counters[1] > 0
    assert counters[4] == pytest.approx(counters[1] / 4)
