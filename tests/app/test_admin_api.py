"""The admin API over HTTP: tenants (create, list, get, rename, move tier, disable) and their API keys
(create, list without secrets, revoke, expiry). Tenants and keys are never deleted, only disabled/revoked.
"""

import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from billing import repository
from tests.app.conftest import Served
from tests.app.helpers import unique

ERROR_KEYS = {"message", "type", "param", "code"}
KEY_FORMAT = re.compile(r"^sk-lp-([A-Za-z0-9]{12})_([A-Za-z0-9_-]{43})$")
TENANT_ID = re.compile(r"^ten_[a-z2-7]{20}$")
KEY_ID = re.compile(r"^key_[a-z2-7]{20}$")
TENANT_FIELDS = {
    *("id", "object", "name", "tier", "status", "created_at", "updated_at", "disabled_at"),
    *("rpm", "tpm", "max_concurrent", "max_tokens_cap", "limits", "stripe_customer_id"),
}
KEY_FIELDS = {"id", "object", "tenant_id", "name", "prefix", "created_at", "expires_at", "revoked_at"}
WAIT_S = 2.0  # ten times the fixture's auth cache TTL


def when(value: str) -> datetime:
    parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    assert parsed.tzinfo is not None, f"{value} has no timezone"
    return parsed


def assert_error(
    r: httpx.Response, status: int, *, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers.get("x-request-id")
    body = r.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == ERROR_KEYS, body
    if code is not None:
        assert body["error"]["code"] == code, body
    if param is not None:
        assert body["error"]["param"] == param, body
    return dict(body["error"])


def models_status(served: Served, key: str) -> int:
    return httpx.get(f"{served.url}/v1/models", headers={"authorization": f"Bearer {key}"}).status_code


def wait_for_401(served: Served, key: str) -> int:
    deadline = time.monotonic() + WAIT_S
    while (status := models_status(served, key)) != 401 and time.monotonic() < deadline:
        time.sleep(0.05)
    return status


@pytest.fixture(scope="module")
def admin(served: Served) -> Iterator[httpx.Client]:
    with served.admin() as client:
        yield client


@pytest.fixture(scope="module")
def pro_tier(served: Served) -> str:
    """A second tier, made in the database directly."""
    name = unique("pro")
    with served.services.session_factory() as session, session.begin():
        repository.create_tier(session, name=name, description="test tier")
    return name


@pytest.fixture
def new_tenant(admin: httpx.Client) -> dict[str, Any]:
    r = admin.post("/admin/tenants", json={"name": unique("t")})
    assert r.status_code == 201, r.text
    return dict(r.json())


def tenant_names(admin: httpx.Client) -> set[str]:
    return {t["name"] for t in admin.get("/admin/tenants").json()["data"]}


# -- tenants -------------------------------------------------------------------------------------------


def test_create_tenant(admin: httpx.Client) -> None:
    name = unique("create")
    before = datetime.now(UTC)
    r = admin.post("/admin/tenants", json={"name": name, "tier": "free"})
    assert r.status_code == 201, r.text
    assert r.headers.get("x-request-id")
    tenant = r.json()
    assert set(tenant) == TENANT_FIELDS
    assert TENANT_ID.match(tenant["id"])
    assert tenant["object"] == "tenant"
    assert (tenant["name"], tenant["tier"], tenant["status"]) == (name, "free", "active")
    assert tenant["disabled_at"] is None
    assert (
        before - timedelta(seconds=5)
        <= when(tenant["created_at"])
        <= datetime.now(UTC) + timedelta(seconds=5)
    )
    assert tenant["updated_at"] == tenant["created_at"]


def test_tier_defaults_to_free(admin: httpx.Client) -> None:
    r = admin.post("/admin/tenants", json={"name": unique("default-tier")})
    assert r.status_code == 201, r.text
    assert r.json()["tier"] == "free"


def test_create_tenant_in_another_tier(admin: httpx.Client, pro_tier: str) -> None:
    r = admin.post("/admin/tenants", json={"name": unique("pro-tenant"), "tier": pro_tier})
    assert r.status_code == 201, r.text
    assert r.json()["tier"] == pro_tier


def test_tenant_ids_are_unique(admin: httpx.Client) -> None:
    ids = {admin.post("/admin/tenants", json={"name": unique("ids")}).json()["id"] for _ in range(5)}
    assert len(ids) == 5


def test_duplicate_name_is_409(admin: httpx.Client, new_tenant: dict[str, Any]) -> None:
    r = admin.post("/admin/tenants", json={"name": new_tenant["name"]})
    error = assert_error(r, 409, code="conflict", param="name")
    assert new_tenant["name"] in error["message"]
    assert [n for n in tenant_names(admin) if n == new_tenant["name"]] == [new_tenant["name"]]


def test_duplicate_name_of_a_disabled_tenant_is_still_409(
    admin: httpx.Client, new_tenant: dict[str, Any]
) -> None:
    assert admin.delete(f"/admin/tenants/{new_tenant['id']}").status_code == 200
    assert_error(admin.post("/admin/tenants", json={"name": new_tenant["name"]}), 409, code="conflict")


def test_names_are_case_sensitive(admin: httpx.Client, new_tenant: dict[str, Any]) -> None:
    r = admin.post("/admin/tenants", json={"name": new_tenant["name"].upper()})
    assert r.status_code == 201, r.text


def test_unknown_tier_is_400(admin: httpx.Client) -> None:
    name = unique("no-tier")
    error = assert_error(
        admin.post("/admin/tenants", json={"name": name, "tier": "platinum"}),
        400,
        code="tier_not_found",
        param="tier",
    )
    assert "platinum" in error["message"]
    assert name not in tenant_names(admin)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "name"),
        ({"name": ""}, "name"),
        ({"name": "x" * 129}, "name"),
        ({"name": 42}, "name"),
        ({"name": None}, "name"),
        ({"name": "ok", "tier": ""}, "tier"),
        ({"name": "ok", "tier": "x" * 65}, "tier"),
    ],
    ids=["missing-name", "empty-name", "long-name", "int-name", "null-name", "empty-tier", "long-tier"],
)
def test_invalid_tenant_bodies_are_400(admin: httpx.Client, body: dict[str, Any], param: str) -> None:
    assert_error(admin.post("/admin/tenants", json=body), 400, param=param)


def test_longest_name_is_accepted(admin: httpx.Client) -> None:
    name = unique("long").ljust(128, "x")
    r = admin.post("/admin/tenants", json={"name": name})
    assert r.status_code == 201, r.text
    assert r.json()["name"] == name


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/admin/tenants", {"name": "extra", "plan": "gold"}),
        ("PATCH", "/admin/tenants/{id}", {"plan": "gold"}),
        ("PATCH", "/admin/tenants/{id}", {"name": "renamed-extra", "status": "active"}),
        ("POST", "/admin/tenants/{id}/keys", {"name": "k", "scopes": ["all"]}),
        ("POST", "/admin/tenants/{id}/keys", {"key": "sk-lp-chosen-by-caller"}),
    ],
    ids=["create-tenant", "update-tenant", "update-status", "create-key", "choose-key"],
)
def test_unknown_body_fields_are_refused_by_name(
    admin: httpx.Client, new_tenant: dict[str, Any], method: str, path: str, body: dict[str, Any]
) -> None:
    extra = next(k for k in body if k not in {"name"})
    r = admin.request(method, path.format(id=new_tenant["id"]), json=body)
    error = assert_error(r, 400, param=extra)
    assert error["message"] == f"Unrecognized request argument supplied: {extra}"
    assert admin.get(f"/admin/tenants/{new_tenant['id']}").json() == new_tenant  # nothing changed
    assert admin.get(f"/admin/tenants/{new_tenant['id']}/keys").json()["data"] == []
    assert "extra" not in tenant_names(admin)


def test_list_tenants(admin: httpx.Client) -> None:
    created = [admin.post("/admin/tenants", json={"name": unique("list")}).json() for _ in range(3)]
    r = admin.get("/admin/tenants")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    by_id = {t["id"]: t for t in body["data"]}
    for tenant in created:
        assert by_id[tenant["id"]] == tenant
    assert all(set(t) == TENANT_FIELDS for t in body["data"])
    positions = [list(by_id).index(t["id"]) for t in created]
    assert positions == sorted(positions), "listed in creation order"


def test_get_tenant(admin: httpx.Client, new_tenant: dict[str, Any]) -> None:
    r = admin.get(f"/admin/tenants/{new_tenant['id']}")
    assert r.status_code == 200
    assert r.json() == new_tenant


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/admin/tenants/{id}", None),
        ("PATCH", "/admin/tenants/{id}", {"name": "ghost-renamed"}),
        ("DELETE", "/admin/tenants/{id}", None),
        ("GET", "/admin/tenants/{id}/keys", None),
        ("POST", "/admin/tenants/{id}/keys", {"name": "ghost-key"}),
        ("DELETE", "/admin/keys/{id}", None),
    ],
    ids=["get", "update", "disable", "list-keys", "create-key", "revoke-key"],
)
@pytest.mark.parametrize("missing", ["ten_aaaaaaaaaaaaaaaaaaaa", "key_aaaaaaaaaaaaaaaaaaaa", "nope"])
def test_unknown_ids_are_404(
    admin: httpx.Client, method: str, path: str, body: dict[str, Any] | None, missing: str
) -> None:
    r = admin.request(method, path.format(id=missing), json=body)
    error = assert_error(r, 404, code="not_found")
    assert missing in error["message"]


def test_rename_tenant(admin: httpx.Client, new_tenant: dict[str, Any]) -> None:
    name = unique("renamed")
    r = admin.patch(f"/admin/tenants/{new_tenant['id']}", json={"name": name})
    assert r.status_code == 200, r.text
    updated = r.json()
    assert updated["name"] == name
    assert (updated["id"], updated["tier"], updated["status"]) == (new_tenant["id"], "free", "active")
    assert updated["created_at"] == new_tenant["created_at"]
    assert when(updated["updated_at"]) > when(new_tenant["updated_at"])
    assert admin.get(f"/admin/tenants/{new_tenant['id']}").json() == updated
    names = tenant_names(admin)
    assert name in names and new_tenant["name"] not in names
    # the old name is free again
    assert admin.post("/admin/tenants", json={"name": new_tenant["name"]}).status_code == 201


def test_move_tenant_to_another_tier(admin: httpx.Client, new_tenant: dict[str, Any], pro_tier: str) -> None:
    r = admin.patch(f"/admin/tenants/{new_tenant['id']}", json={"tier": pro_tier})
    assert r.status_code == 200, r.text
    assert (r.json()["tier"], r.json()["name"]) == (pro_tier, new_tenant["name"])
    assert admin.get(f"/admin/tenants/{new_tenant['id']}").json()["tier"] == pro_tier
    back = admin.patch(f"/admin/tenants/{new_tenant['id']}", json={"tier": "free"})
    assert back.json()["tier"] == "free"


def test_rename_and_move_at_once(admin: httpx.Client, new_tenant: dict[str, Any], pro_tier: str) -> None:
    name = unique("both")
    r = admin.patch(f"/admin/tenants/{new_tenant['id']}", json={"name": name, "tier": pro_tier})
    assert r.status_code == 200, r.text
    assert (r.json()["name"], r.json()["tier"]) == (name, pro_tier)


def test_empty_patch_changes_nothing(admin: httpx.Client, new_tenant: dict[str, Any]) -> None:
    for body in ({}, {"name": None, "tier": None}):
        r = admin.patch(f"/admin/tenants/{new_tenant['id']}", json=body)
        assert r.status_code == 200, r.text
        assert r.json() == new_tenant


def test_rename_to_the_same_name_is_fine(admin: httpx.Client, new_tenant: dict[str, Any]) -> None:
    r = admin.patch(f"/admin/tenants/{new_tenant['id']}", json={"name": new_tenant["name"]})
    assert r.status_code == 200, r.text
    assert r.json()["name"] == new_tenant["name"]


def test_rename_to_a_taken_name_is_409(admin: httpx.Client, new_tenant: dict[str, Any]) -> None:
    other = admin.post("/admin/tenants", json={"name": unique("taken")}).json()
    r = admin.patch(f"/admin/tenants/{new_tenant['id']}", json={"name": other["name"]})
    assert_error(r, 409, code="conflict", param="name")
    assert admin.get(f"/admin/tenants/{new_tenant['id']}").json() == new_tenant


def test_move_to_an_unknown_tier_is_400(admin: httpx.Client, new_tenant: dict[str, Any]) -> None:
    r = admin.patch(f"/admin/tenants/{new_tenant['id']}", json={"tier": "platinum"})
    assert_error(r, 400, code="tier_not_found", param="tier")
    assert admin.get(f"/admin/tenants/{new_tenant['id']}").json() == new_tenant


def test_a_failed_update_changes_nothing(admin: httpx.Client, new_tenant: dict[str, Any]) -> None:
    """Rename and unknown tier in one request: the whole update is refused, the rename included."""
    r = admin.patch(f"/admin/tenants/{new_tenant['id']}", json={"name": unique("half"), "tier": "platinum"})
    assert_error(r, 400, param="tier")
    assert admin.get(f"/admin/tenants/{new_tenant['id']}").json() == new_tenant


@pytest.mark.parametrize(
    ("body", "param"),
    [({"name": ""}, "name"), ({"name": "x" * 129}, "name"), ({"tier": ""}, "tier")],
    ids=["empty-name", "long-name", "empty-tier"],
)
def test_invalid_updates_are_400(
    admin: httpx.Client, new_tenant: dict[str, Any], body: dict[str, Any], param: str
) -> None:
    assert_error(admin.patch(f"/admin/tenants/{new_tenant['id']}", json=body), 400, param=param)


def test_disable_tenant(served: Served, admin: httpx.Client) -> None:
    tenant_id, key = served.new_tenant(unique("disable"))
    second = admin.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "second"}).json()
    assert models_status(served, key) == 200
    assert models_status(served, second["key"]) == 200
    before = datetime.now(UTC)
    r = admin.delete(f"/admin/tenants/{tenant_id}")
    assert r.status_code == 200, r.text
    disabled = r.json()
    assert disabled["id"] == tenant_id
    assert disabled["status"] == "disabled"
    assert disabled["disabled_at"] is not None
    assert (
        before - timedelta(seconds=5)
        <= when(disabled["disabled_at"])
        <= datetime.now(UTC) + timedelta(seconds=5)
    )
    # still there: never deleted
    assert admin.get(f"/admin/tenants/{tenant_id}").json() == disabled
    listed = {t["id"]: t for t in admin.get("/admin/tenants").json()["data"]}
    assert listed[tenant_id] == disabled
    # its keys are revoked, and stop working
    keys = admin.get(f"/admin/tenants/{tenant_id}/keys").json()["data"]
    assert len(keys) == 2
    assert all(k["revoked_at"] is not None for k in keys)
    assert wait_for_401(served, key) == 401
    assert wait_for_401(served, second["key"]) == 401


def test_disable_is_idempotent(admin: httpx.Client, new_tenant: dict[str, Any]) -> None:
    first = admin.delete(f"/admin/tenants/{new_tenant['id']}").json()
    again = admin.delete(f"/admin/tenants/{new_tenant['id']}")
    assert again.status_code == 200
    assert again.json()["disabled_at"] == first["disabled_at"]
    assert again.json()["status"] == "disabled"


def test_a_disabled_tenant_gets_no_new_keys(served: Served, admin: httpx.Client) -> None:
    tenant_id, _ = served.new_tenant(unique("no-new-keys"))
    admin.delete(f"/admin/tenants/{tenant_id}")
    assert_error(admin.post(f"/admin/tenants/{tenant_id}/keys", json={}), 404, code="not_found")
    assert len(admin.get(f"/admin/tenants/{tenant_id}/keys").json()["data"]) == 1


def test_disabling_one_tenant_leaves_the_others(served: Served, admin: httpx.Client) -> None:
    doomed_id, doomed_key = served.new_tenant(unique("doomed"))
    _, kept_key = served.new_tenant(unique("kept"))
    admin.delete(f"/admin/tenants/{doomed_id}")
    assert wait_for_401(served, doomed_key) == 401
    assert models_status(served, kept_key) == 200


# -- API keys --------------------------------------------------------------------------------------------


def test_create_key(served: Served, admin: httpx.Client, new_tenant: dict[str, Any]) -> None:
    before = datetime.now(UTC)
    r = admin.post(f"/admin/tenants/{new_tenant['id']}/keys", json={"name": "ci"})
    assert r.status_code == 201, r.text
    created = r.json()
    assert set(created) == KEY_FIELDS | {"key"}
    match = KEY_FORMAT.match(created["key"])
    assert match, created["key"]
    assert created["prefix"] == match.group(1)
    assert KEY_ID.match(created["id"])
    assert created["object"] == "api_key"
    assert (created["tenant_id"], created["name"]) == (new_tenant["id"], "ci")
    assert created["expires_at"] is None and created["revoked_at"] is None
    assert (
        before - timedelta(seconds=5)
        <= when(created["created_at"])
        <= datetime.now(UTC) + timedelta(seconds=5)
    )
    assert models_status(served, created["key"]) == 200


def test_key_name_is_optional(admin: httpx.Client, new_tenant: dict[str, Any]) -> None:
    r = admin.post(f"/admin/tenants/{new_tenant['id']}/keys", json={})
    assert r.status_code == 201, r.text
    assert r.json()["name"] is None


def test_key_name_longer_than_128_is_400(admin: httpx.Client, new_tenant: dict[str, Any]) -> None:
    r = admin.post(f"/admin/tenants/{new_tenant['id']}/keys", json={"name": "k" * 129})
    assert_error(r, 400, param="name")


def test_keys_are_all_different(admin: httpx.Client, new_tenant: dict[str, Any]) -> None:
    made = [admin.post(f"/admin/tenants/{new_tenant['id']}/keys", json={}).json() for _ in range(5)]
    assert len({k["key"] for k in made}) == 5
    assert len({k["prefix"] for k in made}) == 5
    assert len({k["id"] for k in made}) == 5
    assert len({KEY_FORMAT.match(k["key"]).group(2) for k in made}) == 5  # type: ignore[union-attr]


def test_listed_keys_reveal_no_secret(admin: httpx.Client, new_tenant: dict[str, Any]) -> None:
    made = [
        admin.post(f"/admin/tenants/{new_tenant['id']}/keys", json={"name": f"k{i}"}).json() for i in range(3)
    ]
    r = admin.get(f"/admin/tenants/{new_tenant['id']}/keys")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [k["id"] for k in body["data"]] == [k["id"] for k in made]
    for listed, created in zip(body["data"], made, strict=True):
        assert set(listed) == KEY_FIELDS, listed  # no `key`, no hash
        assert listed == {k: v for k, v in created.items() if k != "key"}
        secret = KEY_FORMAT.match(created["key"]).group(2)  # type: ignore[union-attr]
        assert created["key"] not in r.text
        assert secret not in r.text
        assert all(secret not in str(value) for value in listed.values())
    # nor does any other admin view
    for path in (f"/admin/tenants/{new_tenant['id']}", "/admin/tenants"):
        text = admin.get(path).text
        assert not any(KEY_FORMAT.match(k["key"]).group(2) in text for k in made)  # type: ignore[union-attr]


def test_keys_are_listed_per_tenant(served: Served, admin: httpx.Client) -> None:
    first_id, _ = served.new_tenant(unique("keys-a"))
    second_id, _ = served.new_tenant(unique("keys-b"))
    admin.post(f"/admin/tenants/{first_id}/keys", json={"name": "extra"})
    first = admin.get(f"/admin/tenants/{first_id}/keys").json()["data"]
    second = admin.get(f"/admin/tenants/{second_id}/keys").json()["data"]
    assert len(first) == 2 and len(second) == 1
    assert {k["tenant_id"] for k in first} == {first_id}
    assert {k["tenant_id"] for k in second} == {second_id}


def test_a_new_tenant_has_no_keys(admin: httpx.Client, new_tenant: dict[str, Any]) -> None:
    r = admin.get(f"/admin/tenants/{new_tenant['id']}/keys")
    assert r.status_code == 200
    assert r.json() == {"object": "list", "data": []}


def test_revoke_key(served: Served, admin: httpx.Client, new_tenant: dict[str, Any]) -> None:
    doomed = admin.post(f"/admin/tenants/{new_tenant['id']}/keys", json={"name": "doomed"}).json()
    kept = admin.post(f"/admin/tenants/{new_tenant['id']}/keys", json={"name": "kept"}).json()
    assert models_status(served, doomed["key"]) == 200
    r = admin.delete(f"/admin/keys/{doomed['id']}")
    assert r.status_code == 200, r.text
    revoked = r.json()
    assert set(revoked) == KEY_FIELDS
    assert revoked["id"] == doomed["id"]
    assert revoked["revoked_at"] is not None
    assert when(revoked["revoked_at"]) >= when(doomed["created_at"])
    assert wait_for_401(served, doomed["key"]) == 401
    assert models_status(served, kept["key"]) == 200
    # still listed, as revoked
    listed = {k["id"]: k for k in admin.get(f"/admin/tenants/{new_tenant['id']}/keys").json()["data"]}
    assert listed[doomed["id"]] == revoked
    assert listed[kept["id"]]["revoked_at"] is None
    # revoking a key leaves its tenant active
    assert admin.get(f"/admin/tenants/{new_tenant['id']}").json()["status"] == "active"


def test_revoke_is_idempotent(admin: httpx.Client, new_tenant: dict[str, Any]) -> None:
    key = admin.post(f"/admin/tenants/{new_tenant['id']}/keys", json={}).json()
    first = admin.delete(f"/admin/keys/{key['id']}").json()
    time.sleep(0.01)
    again = admin.delete(f"/admin/keys/{key['id']}")
    assert again.status_code == 200
    assert again.json() == first


# -- key expiry -------------------------------------------------------------------------------------------


def test_expires_in_days(served: Served, admin: httpx.Client, new_tenant: dict[str, Any]) -> None:
    before = datetime.now(UTC)
    r = admin.post(f"/admin/tenants/{new_tenant['id']}/keys", json={"expires_in_days": 30})
    after = datetime.now(UTC)
    assert r.status_code == 201, r.text
    expires_at = when(r.json()["expires_at"])
    assert before + timedelta(days=30) <= expires_at <= after + timedelta(days=30)
    listed = admin.get(f"/admin/tenants/{new_tenant['id']}/keys").json()["data"]
    assert when(listed[0]["expires_at"]) == expires_at
    assert models_status(served, r.json()["key"]) == 200


@pytest.mark.parametrize(
    ("sent", "expected"),
    [
        ("2099-01-01T00:00:00Z", datetime(2099, 1, 1, tzinfo=UTC)),
        ("2099-01-01T00:00:00+00:00", datetime(2099, 1, 1, tzinfo=UTC)),
        ("2099-01-01T00:00:00+02:00", datetime(2098, 12, 31, 22, tzinfo=UTC)),
        ("2099-01-01T00:00:00-05:30", datetime(2099, 1, 1, 5, 30, tzinfo=UTC)),
        ("2099-01-01T00:00:00", datetime(2099, 1, 1, tzinfo=UTC)),  # naive: taken as UTC
    ],
    ids=["z", "utc-offset", "plus-2", "minus-5-30", "naive"],
)
def test_expires_at_keeps_the_instant(
    served: Served, admin: httpx.Client, new_tenant: dict[str, Any], sent: str, expected: datetime
) -> None:
    r = admin.post(f"/admin/tenants/{new_tenant['id']}/keys", json={"expires_at": sent})
    assert r.status_code == 201, r.text
    assert when(r.json()["expires_at"]) == expected
    listed = admin.get(f"/admin/tenants/{new_tenant['id']}/keys").json()["data"]
    assert when(listed[0]["expires_at"]) == expected
    assert models_status(served, r.json()["key"]) == 200


@pytest.mark.parametrize(
    "expires_at",
    [
        "2000-01-01T00:00:00Z",
        (datetime.now(UTC) - timedelta(minutes=1)).isoformat(),
        "2000-01-01T00:00:00",
    ],
    ids=["long-ago", "a-minute-ago", "naive-past"],
)
def test_expires_at_in_the_past_is_400(
    admin: httpx.Client, new_tenant: dict[str, Any], expires_at: str
) -> None:
    r = admin.post(f"/admin/tenants/{new_tenant['id']}/keys", json={"expires_at": expires_at})
    assert_error(r, 400, param="expires_at")
    assert admin.get(f"/admin/tenants/{new_tenant['id']}/keys").json()["data"] == []


def test_expires_at_now_is_400(admin: httpx.Client, new_tenant: dict[str, Any]) -> None:
    """A key that expires the moment it is made would never work."""
    r = admin.post(
        f"/admin/tenants/{new_tenant['id']}/keys", json={"expires_at": datetime.now(UTC).isoformat()}
    )
    assert_error(r, 400, param="expires_at")


def test_expires_at_and_expires_in_days_together_is_400(
    admin: httpx.Client, new_tenant: dict[str, Any]
) -> None:
    body = {"expires_at": "2099-01-01T00:00:00Z", "expires_in_days": 30}
    error = assert_error(admin.post(f"/admin/tenants/{new_tenant['id']}/keys", json=body), 400)
    assert error["param"] in {"expires_at", "expires_in_days"}
    assert admin.get(f"/admin/tenants/{new_tenant['id']}/keys").json()["data"] == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"expires_in_days": 0}, "expires_in_days"),
        ({"expires_in_days": -1}, "expires_in_days"),
        ({"expires_in_days": 3651}, "expires_in_days"),
        ({"expires_in_days": 1.5}, "expires_in_days"),
        ({"expires_at": "tomorrow"}, "expires_at"),
        ({"expires_at": "2099-13-01T00:00:00Z"}, "expires_at"),
    ],
    ids=["days-0", "days-negative", "days-too-many", "days-fraction", "words", "month-13"],
)
def test_invalid_expiry_is_400(
    admin: httpx.Client, new_tenant: dict[str, Any], body: dict[str, Any], param: str
) -> None:
    assert_error(admin.post(f"/admin/tenants/{new_tenant['id']}/keys", json=body), 400, param=param)


def test_longest_expiry_is_accepted(admin: httpx.Client, new_tenant: dict[str, Any]) -> None:
    r = admin.post(f"/admin/tenants/{new_tenant['id']}/keys", json={"expires_in_days": 3650})
    assert r.status_code == 201, r.text


def test_an_expired_key_is_still_listed(
    served: Served, admin: httpx.Client, new_tenant: dict[str, Any]
) -> None:
    soon = datetime.now(UTC) + timedelta(seconds=0.5)
    key = admin.post(f"/admin/tenants/{new_tenant['id']}/keys", json={"expires_at": soon.isoformat()}).json()
    time.sleep(0.6)
    assert wait_for_401(served, key["key"]) == 401
    listed = admin.get(f"/admin/tenants/{new_tenant['id']}/keys").json()["data"]
    assert [k["id"] for k in listed] == [key["id"]]
    assert listed[0]["revoked_at"] is None
    assert when(listed[0]["expires_at"]) == soon
