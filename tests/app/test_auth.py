"""Tenant API keys on the inference endpoints, and the admin key on /admin: who gets in, who gets a 401.

A 401 for a key says nothing about the key: unknown, wrong secret, revoked, expired and disabled-tenant
keys all get the same answer. Revocation, expiry and disabling apply within the authenticator's cache TTL
(0.2 s in the fixture), so those tests poll for up to ~2 s.
"""

import secrets
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import httpx
import pytest

from tests.app.conftest import ADMIN_KEY, MODEL, Served
from tests.app.helpers import unique

ERROR_KEYS = {"message", "type", "param", "code"}
INCORRECT = "Incorrect API key provided."
WAIT_S = 2.0  # ten times the fixture's auth cache TTL

# (name, method, path, body) for every route that takes a tenant key
TENANT_ROUTES: list[tuple[str, str, str, dict[str, Any] | None]] = [
    (
        "chat",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    ),
    ("completions", "POST", "/v1/completions", {"model": MODEL, "prompt": "hi"}),
    ("models", "GET", "/v1/models", None),
    ("model", "GET", f"/v1/models/{MODEL}", None),
]
ROUTE_IDS = [r[0] for r in TENANT_ROUTES]


def call(
    served: Served, method: str, path: str, body: dict[str, Any] | None, **headers: str
) -> httpx.Response:
    if body is not None:
        body = {**body, "max_tokens": 1}
    return httpx.request(method, f"{served.url}{path}", json=body, headers=headers, timeout=30)


def models(served: Served, key: str) -> httpx.Response:
    return httpx.get(f"{served.url}/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=30)


def assert_401(r: httpx.Response, code: str = "invalid_api_key") -> dict[str, Any]:
    assert r.status_code == 401, r.text
    assert r.headers.get("x-request-id")
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == ERROR_KEYS
    assert body["error"]["code"] == code, body
    return dict(body["error"])


def wait_for_status(
    request: Callable[[], httpx.Response], status: int, timeout: float = WAIT_S
) -> httpx.Response:
    """Repeat `request` until it answers `status` or `timeout` passes; the last response."""
    deadline = time.monotonic() + timeout
    while True:
        r = request()
        if r.status_code == status or time.monotonic() >= deadline:
            return r
        time.sleep(0.05)


def split(key: str) -> tuple[str, str]:
    """(prefix, secret) of a well-formed key `sk-lp-<12>_<43>` (the secret itself may contain '_')."""
    assert key.startswith("sk-lp-") and key[18] == "_", key
    return key[6:18], key[19:]


def other_secret(key: str) -> str:
    """The same public prefix with a different, well-formed secret."""
    prefix, secret = split(key)
    while True:
        candidate = secrets.token_urlsafe(32)
        if candidate != secret:
            return f"sk-lp-{prefix}_{candidate}"


@pytest.fixture
def admin(served: Served) -> Iterator[httpx.Client]:
    with served.admin() as client:
        yield client


# -- what a valid key gets ---------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "method", "path", "body"), TENANT_ROUTES, ids=ROUTE_IDS)
def test_a_valid_key_is_served(
    served: Served, tenant: tuple[str, str], name: str, method: str, path: str, body: dict[str, Any] | None
) -> None:
    _, key = tenant
    r = call(served, method, path, body, authorization=f"Bearer {key}")
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer"])
def test_the_bearer_scheme_is_case_insensitive(served: Served, tenant: tuple[str, str], scheme: str) -> None:
    _, key = tenant
    assert models(served, key).status_code == 200
    r = httpx.get(f"{served.url}/v1/models", headers={"authorization": f"{scheme} {key}"})
    assert r.status_code == 200, r.text


# -- missing and malformed keys ----------------------------------------------------------------------


@pytest.mark.parametrize(("name", "method", "path", "body"), TENANT_ROUTES, ids=ROUTE_IDS)
def test_no_authorization_header_is_401(
    served: Served, name: str, method: str, path: str, body: dict[str, Any] | None
) -> None:
    error = assert_401(call(served, method, path, body))
    assert "API key" in error["message"]


@pytest.mark.parametrize(("name", "method", "path", "body"), TENANT_ROUTES, ids=ROUTE_IDS)
def test_empty_authorization_header_is_401(
    served: Served, name: str, method: str, path: str, body: dict[str, Any] | None
) -> None:
    assert_401(call(served, method, path, body, authorization=""))


def _malformed(key: str) -> dict[str, str]:
    prefix, secret = split(key)
    return {
        "bare-word": "Bearer nope",
        "bearer-only": "Bearer",
        "no-scheme": key,
        "basic-scheme": f"Basic {key}",
        "token-scheme": f"Token {key}",
        "openai-style": "Bearer sk-" + "a" * 48,
        "other-product-prefix": f"Bearer sk-xx-{prefix}_{secret}",
        "short-prefix": f"Bearer sk-lp-{prefix[:11]}_{secret}",
        "long-prefix": f"Bearer sk-lp-{prefix}a_{secret}",
        "short-secret": f"Bearer sk-lp-{prefix}_{secret[:42]}",
        "long-secret": f"Bearer sk-lp-{prefix}_{secret}a",
        "bad-character-in-prefix": f"Bearer sk-lp-{prefix[:11]}!_{secret}",
        "bad-character-in-secret": f"Bearer sk-lp-{prefix}_{secret[:42]}+",
        "missing-separator": f"Bearer sk-lp-{prefix}{secret}",
        "key-twice": f"Bearer {key} {key}",
        "prefix-only": f"Bearer sk-lp-{prefix}",
        "admin-key": f"Bearer {ADMIN_KEY}",
    }


MALFORMED = list(_malformed("sk-lp-" + "a" * 12 + "_" + "b" * 43))


@pytest.mark.parametrize("variant", MALFORMED)
@pytest.mark.parametrize(("name", "method", "path", "body"), TENANT_ROUTES, ids=ROUTE_IDS)
def test_malformed_keys_are_401(
    served: Served,
    tenant: tuple[str, str],
    variant: str,
    name: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
) -> None:
    _, key = tenant  # built from the real key, so only the malformation stands between it and a 200
    error = assert_401(call(served, method, path, body, authorization=_malformed(key)[variant]))
    assert error["message"] == INCORRECT


@pytest.mark.parametrize(("name", "method", "path", "body"), TENANT_ROUTES, ids=ROUTE_IDS)
def test_wrong_secret_with_a_real_prefix_is_401(
    served: Served,
    tenant: tuple[str, str],
    name: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
) -> None:
    _, key = tenant
    assert models(served, key).status_code == 200  # the real key is valid (and now cached)
    error = assert_401(call(served, method, path, body, authorization=f"Bearer {other_secret(key)}"))
    assert error["message"] == INCORRECT


def test_a_one_character_change_in_the_secret_is_401(served: Served, tenant: tuple[str, str]) -> None:
    _, key = tenant
    flipped = key[:-1] + ("A" if key[-1] != "A" else "B")
    assert models(served, key).status_code == 200
    assert_401(models(served, flipped))
    assert models(served, key).status_code == 200  # a failed attempt does nothing to the real key


def test_a_well_formed_unknown_key_is_401(served: Served) -> None:
    unknown = f"sk-lp-{'Z' * 12}_{secrets.token_urlsafe(32)}"
    assert assert_401(models(served, unknown))["message"] == INCORRECT


def test_the_admin_key_is_not_a_tenant_key(served: Served) -> None:
    for _, method, path, body in TENANT_ROUTES:
        assert_401(call(served, method, path, body, authorization=f"Bearer {ADMIN_KEY}"))


# -- keys that stop working ----------------------------------------------------------------------------


def test_a_revoked_key_stops_working(served: Served, admin: httpx.Client) -> None:
    tenant_id, kept = served.new_tenant(unique("revoke"))
    created = admin.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "to-revoke"}).json()
    key = created["key"]
    assert models(served, key).status_code == 200  # cached as valid
    assert admin.delete(f"/admin/keys/{created['id']}").status_code == 200
    r = wait_for_status(partial(models, served, key), 401)
    assert assert_401(r)["message"] == INCORRECT
    for _, method, path, body in TENANT_ROUTES:
        assert_401(call(served, method, path, body, authorization=f"Bearer {key}"))
    assert models(served, kept).status_code == 200  # the tenant's other key is untouched


def test_an_expired_key_stops_working(served: Served, admin: httpx.Client) -> None:
    tenant_id, kept = served.new_tenant(unique("expire"))
    expires_at = datetime.now(UTC) + timedelta(seconds=1.5)
    r = admin.post(f"/admin/tenants/{tenant_id}/keys", json={"expires_at": expires_at.isoformat()})
    assert r.status_code == 201, r.text
    key = r.json()["key"]
    assert models(served, key).status_code == 200  # valid until then
    time.sleep(max(0.0, (expires_at - datetime.now(UTC)).total_seconds()))
    r = wait_for_status(partial(models, served, key), 401)
    assert assert_401(r)["message"] == INCORRECT
    assert datetime.now(UTC) >= expires_at
    assert models(served, kept).status_code == 200


def test_keys_of_a_disabled_tenant_stop_working(served: Served, admin: httpx.Client) -> None:
    tenant_id, first = served.new_tenant(unique("disable"))
    second = admin.post(f"/admin/tenants/{tenant_id}/keys", json={}).json()["key"]
    _, other = served.new_tenant(unique("bystander"))
    for key in (first, second, other):
        assert models(served, key).status_code == 200
    assert admin.delete(f"/admin/tenants/{tenant_id}").status_code == 200
    for key in (first, second):
        r = wait_for_status(partial(models, served, key), 401)
        assert assert_401(r)["message"] == INCORRECT
        for _, method, path, body in TENANT_ROUTES:
            assert_401(call(served, method, path, body, authorization=f"Bearer {key}"))
    assert models(served, other).status_code == 200


def test_a_401_does_not_tell_which_keys_exist(served: Served, admin: httpx.Client) -> None:
    """Unknown, wrong secret, revoked, expired, disabled: one identical error, naming nothing of the key."""
    tenant_id, live = served.new_tenant(unique("oracle"))
    revoked = admin.post(f"/admin/tenants/{tenant_id}/keys", json={}).json()
    soon = (datetime.now(UTC) + timedelta(seconds=0.5)).isoformat()
    expiring = admin.post(f"/admin/tenants/{tenant_id}/keys", json={"expires_at": soon}).json()
    doomed_tenant_id, doomed = served.new_tenant(unique("oracle-disabled"))
    admin.delete(f"/admin/keys/{revoked['id']}")
    admin.delete(f"/admin/tenants/{doomed_tenant_id}")
    time.sleep(0.6)
    candidates = {
        "unknown": f"sk-lp-{'Q' * 12}_{secrets.token_urlsafe(32)}",
        "wrong-secret": other_secret(live),
        "revoked": revoked["key"],
        "expired": expiring["key"],
        "disabled-tenant": doomed,
        "malformed": "not-a-key",
    }
    errors = {}
    for name, key in candidates.items():
        r = wait_for_status(partial(models, served, key), 401)
        errors[name] = assert_401(r)
        pieces = split(key) if key.startswith("sk-lp-") else (key,)
        assert not any(piece in r.text for piece in pieces), (name, r.text)
    assert all(e == errors["unknown"] for e in errors.values()), errors
    assert errors["unknown"] == {
        "message": INCORRECT,
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }


# -- the admin key ------------------------------------------------------------------------------------

ADMIN_ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/admin/tenants", None),
    ("POST", "/admin/tenants", {"name": "never-created"}),
    ("GET", "/admin/tenants/{tenant}", None),
    ("PATCH", "/admin/tenants/{tenant}", {"name": "never-renamed"}),
    ("DELETE", "/admin/tenants/{tenant}", None),
    ("GET", "/admin/tenants/{tenant}/keys", None),
    ("POST", "/admin/tenants/{tenant}/keys", {"name": "never-made"}),
    ("DELETE", "/admin/keys/{key}", None),
]
ADMIN_IDS = [f"{m} {p}" for m, p, _ in ADMIN_ROUTES]


@pytest.fixture(scope="module")
def victim(served: Served) -> tuple[str, str, str]:
    """(tenant id, key id, key) that the unauthorised admin calls aim at; they must all stay intact."""
    tenant_id, key = served.new_tenant(unique("victim"))
    with served.admin() as admin:
        key_id = admin.get(f"/admin/tenants/{tenant_id}/keys").json()["data"][0]["id"]
    return tenant_id, key_id, key


def _admin_credentials(tenant_key: str) -> dict[str, dict[str, str]]:
    return {
        "missing": {},
        "empty": {"authorization": ""},
        "wrong": {"authorization": "Bearer not-the-admin-key"},
        "admin-key-prefix": {"authorization": f"Bearer {ADMIN_KEY[:-1]}"},
        "admin-key-longer": {"authorization": f"Bearer {ADMIN_KEY}x"},
        "no-scheme": {"authorization": ADMIN_KEY},
        "basic-scheme": {"authorization": f"Basic {ADMIN_KEY}"},
        "tenant-key": {"authorization": f"Bearer {tenant_key}"},
        "admin-key-in-x-api-key": {"x-api-key": ADMIN_KEY},
    }


CREDENTIALS = list(_admin_credentials(""))


@pytest.mark.parametrize("credentials", CREDENTIALS)
@pytest.mark.parametrize(("method", "path", "body"), ADMIN_ROUTES, ids=ADMIN_IDS)
def test_admin_routes_refuse_anything_but_the_admin_key(
    served: Served,
    victim: tuple[str, str, str],
    credentials: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
) -> None:
    tenant_id, key_id, key = victim
    url = served.url + path.format(tenant=tenant_id, key=key_id)
    headers = _admin_credentials(key)[credentials]
    r = httpx.request(method, url, json=body, headers=headers, timeout=30)
    error = assert_401(r, code="invalid_admin_key")
    assert ADMIN_KEY not in error["message"]


def test_unauthorised_admin_calls_change_nothing(
    served: Served, admin: httpx.Client, victim: tuple[str, str, str]
) -> None:
    tenant_id, key_id, key = victim
    _, _, tenant_key = victim
    for method, path, body in ADMIN_ROUTES:
        url = served.url + path.format(tenant=tenant_id, key=key_id)
        headers = {"authorization": f"Bearer {tenant_key}"}
        assert httpx.request(method, url, json=body, headers=headers).status_code == 401
    tenant = admin.get(f"/admin/tenants/{tenant_id}").json()
    assert tenant["status"] == "active"
    assert tenant["name"].startswith("victim-")
    keys = admin.get(f"/admin/tenants/{tenant_id}/keys").json()["data"]
    assert [k["id"] for k in keys] == [key_id]
    assert keys[0]["revoked_at"] is None
    names = {t["name"] for t in admin.get("/admin/tenants").json()["data"]}
    assert not names & {"never-created", "never-renamed"}
    assert models(served, key).status_code == 200


def test_the_admin_key_works_on_every_admin_route(served: Served, admin: httpx.Client) -> None:
    tenant_id, _ = served.new_tenant(unique("admin-ok"))
    key_id = admin.get(f"/admin/tenants/{tenant_id}/keys").json()["data"][0]["id"]
    calls: list[tuple[str, str, dict[str, Any] | None, int]] = [
        ("GET", "/admin/tenants", None, 200),
        ("POST", "/admin/tenants", {"name": unique("admin-ok-created")}, 201),
        ("GET", f"/admin/tenants/{tenant_id}", None, 200),
        ("PATCH", f"/admin/tenants/{tenant_id}", {"name": unique("admin-ok-renamed")}, 200),
        ("GET", f"/admin/tenants/{tenant_id}/keys", None, 200),
        ("POST", f"/admin/tenants/{tenant_id}/keys", {"name": "second"}, 201),
        ("DELETE", f"/admin/keys/{key_id}", None, 200),
        ("DELETE", f"/admin/tenants/{tenant_id}", None, 200),
    ]
    assert {(m, p.replace(tenant_id, "{tenant}").replace(key_id, "{key}")) for m, p, _, _ in calls} == {
        (m, p) for m, p, _ in ADMIN_ROUTES
    }
    for method, path, body, status in calls:
        r = admin.request(method, path, json=body)
        assert r.status_code == status, (method, path, r.text)


def test_authentication_comes_before_body_validation(served: Served) -> None:
    """An unauthenticated caller learns nothing about the body's schema: 401, not 400."""
    bad_body = {"model": MODEL, "messages": [], "temperature": 9, "surprise": True}
    assert_401(httpx.post(f"{served.url}/v1/chat/completions", json=bad_body))
    r = httpx.post(f"{served.url}/admin/tenants", json={"surprise": True})
    assert_401(r, code="invalid_admin_key")


@pytest.mark.parametrize(
    ("path", "code"),
    [("/v1/chat/completions", "invalid_api_key"), ("/admin/tenants", "invalid_admin_key")],
    ids=["tenant", "admin"],
)
def test_authentication_comes_before_json_parsing(served: Served, path: str, code: str) -> None:
    r = httpx.post(f"{served.url}{path}", content=b'{"model": ', headers={"content-type": "application/json"})
    assert_401(r, code=code)
