"""GET /v1/limits against the live app: the tenant's limits and headroom, which requests use up and reading
never does; the same x-ratelimit-* headers as an admitted request; its errors in the OpenAI shape."""

import asyncio
import time
import uuid
from typing import Any

import httpx
import pytest

from app.limits import Decision, LimiterUnavailable, Limits, WindowState
from billing.models import Tier
from tests.app.conftest import MODEL, Served
from tests.app.helpers import wait_for

ERROR_KEYS = {"message", "type", "param", "code"}


def make_tier(served: Served, **limits: object) -> str:
    name = f"lim-{uuid.uuid4().hex[:8]}"
    with served.services.session_factory() as session, session.begin():
        session.add(Tier(name=name, description="test", **limits))
    return name


def new_key(served: Served, **limits: object) -> tuple[str, str]:
    return served.new_tenant(f"lim-{uuid.uuid4().hex[:8]}", tier=make_tier(served, **limits))


def get_limits(served: Served, key: str) -> httpx.Response:
    return httpx.get(f"{served.url}/v1/limits", headers={"authorization": f"Bearer {key}"}, timeout=30)


def headroom(served: Served, key: str) -> dict[str, Any]:
    r = get_limits(served, key)
    assert r.status_code == 200, r.text
    return dict(r.json()["headroom"])


def complete(served: Served, key: str, **body: object) -> httpx.Response:
    payload = {"model": MODEL, "prompt": "hello there", "max_tokens": 3, "temperature": 0, **body}
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{served.url}/v1/completions", json=payload, headers=headers, timeout=60)


def assert_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert body["error"]["code"] == code, body


def test_a_fresh_tenant_has_all_its_headroom(served: Served) -> None:
    _, key = new_key(served, rpm=10, tpm=5000, max_concurrent=2, max_tokens_cap=64)
    r = get_limits(served, key)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "rate_limits" and body["tier"].startswith("lim-") and body["window_ms"] == 60_000
    assert body["limits"] == {
        "rpm": 10, "tpm": 5000, "max_concurrent": 2, "max_tokens_cap": 64, "on_limit": "reject",
        "max_queue_ms": 0,
    }  # fmt: skip
    assert body["headroom"] == {
        "requests": 0, "remaining_requests": 10, "reset_requests_ms": 0, "tokens": 0,
        "remaining_tokens": 5000, "reset_tokens_ms": 0, "in_flight": 0, "remaining_concurrent": 2,
        "queued": 0,
    }  # fmt: skip
    assert r.headers["x-ratelimit-limit-requests"] == "10"
    assert r.headers["x-ratelimit-remaining-requests"] == "10"
    assert r.headers["x-ratelimit-limit-tokens"] == "5000"
    assert r.headers["x-ratelimit-remaining-tokens"] == "5000"


def test_requests_use_headroom_and_reading_it_does_not(served: Served) -> None:
    _, key = new_key(served, rpm=5, tpm=5000)
    for _ in range(12):  # more reads than the tier's requests per minute: none of them counts
        assert headroom(served, key)["remaining_requests"] == 5
    used = 0
    for n in (1, 2):
        reply = complete(served, key)
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-ratelimit-remaining-requests"] == str(5 - n)
        used += reply.json()["usage"]["total_tokens"]
    # Reservations (prompt + max_tokens) are reconciled to what was used once each request ends.
    wait_for(lambda: headroom(served, key)["tokens"] == used)
    after = get_limits(served, key)
    room = after.json()["headroom"]
    assert (room["requests"], room["remaining_requests"], room["remaining_tokens"]) == (2, 3, 5000 - used)
    assert 0 < room["reset_requests_ms"] <= 60_000 and 0 < room["reset_tokens_ms"] <= 60_000
    assert after.headers["x-ratelimit-remaining-requests"] == "3"
    assert after.headers["x-ratelimit-remaining-tokens"] == str(5000 - used)
    assert after.headers["x-ratelimit-reset-requests"].endswith("s")
    third = complete(served, key)  # the reads in between cost nothing either
    assert third.headers["x-ratelimit-remaining-requests"] == "2"


def test_running_requests_are_in_flight(served: Served) -> None:
    """Leases taken as another ingress replica's running requests would take them (a stream of the tiny
    model ends too fast to be caught running)."""
    tenant_id, key = new_key(served, max_concurrent=3)
    limiter, limits = served.services.limiter, Limits(max_concurrent=3)
    holders = [f"other-replica-{n}" for n in range(2)]
    for holder in holders:
        assert asyncio.run(limiter.admit(tenant_id, holder, limits, 0)).admitted
    room = headroom(served, key)
    assert (room["in_flight"], room["remaining_concurrent"]) == (2, 1)
    assert room["remaining_requests"] is None and room["remaining_tokens"] is None
    for holder in holders:
        asyncio.run(limiter.release(tenant_id, holder, 0))
    wait_for(lambda: headroom(served, key)["in_flight"] == 0)  # reads are up to a second old
    assert complete(served, key).status_code == 200
    wait_for(lambda: headroom(served, key)["in_flight"] == 0)  # the request's own lease is freed too


def test_tenant_overrides_and_unlimited_tiers(served: Served) -> None:
    tenant_id, key = new_key(served)  # a tier without any limit
    r = get_limits(served, key)
    assert r.status_code == 200, r.text
    assert r.json()["headroom"] is None and r.json()["limits"]["rpm"] is None
    assert not any(name.startswith("x-ratelimit") for name in r.headers)
    with served.admin() as admin:
        assert admin.patch(f"/admin/tenants/{tenant_id}", json={"rpm": 7}).status_code == 200
    # The override reaches the API once the key's cached principal expires (auth_cache_ttl_s=0.2).
    wait_for(lambda: get_limits(served, key).json()["limits"]["rpm"] == 7)
    assert headroom(served, key)["remaining_requests"] == 7


def test_limits_need_a_valid_key(served: Served) -> None:
    assert_error(httpx.get(f"{served.url}/v1/limits"), 401, "invalid_api_key")
    assert_error(get_limits(served, "sk-nope"), 401, "invalid_api_key")
    with served.admin() as admin:  # the admin key is not a tenant's
        assert_error(admin.get("/v1/limits"), 401, "invalid_api_key")


class DownLimiter:
    async def admit(self, *args: object, **kwargs: object) -> Decision:
        raise LimiterUnavailable("connection refused")

    async def peek(self, tenant: str) -> WindowState:
        raise LimiterUnavailable("connection refused")


def test_limiter_outage_is_a_503(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    _, key = new_key(served, rpm=5)
    monkeypatch.setattr(served.services, "limiter", DownLimiter())
    monkeypatch.setattr(served.services, "limiter_fail_open", True)  # nothing to let through on a read
    r = get_limits(served, key)
    assert_error(r, 503, "rate_limiter_unavailable")
    assert r.json()["error"]["type"] == "server_error" and r.headers["retry-after"] == "1"


def test_limits_are_in_the_openapi_schema(served: Served) -> None:
    paths = httpx.get(f"{served.url}/openapi.json").json()["paths"]
    assert "get" in paths["/v1/limits"]
    assert not any(path.startswith("/usage") for path in paths)  # the page is not part of the API


class CountingPeeks:
    """The app's limiter, counting the peeks that reach it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.peeks = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def peek(self, tenant: str) -> WindowState:
        self.peeks += 1
        state: WindowState = await self.inner.peek(tenant)
        return state


def test_reads_in_a_loop_reach_the_limiter_once_a_second(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/v1/limits (any tenant, as often as it likes) and the unauthenticated /readyz share the limiter that
    every admission needs: their peeks are cached for a second (issue 14)."""
    _, key = new_key(served, rpm=5)
    counting = CountingPeeks(served.services.limiter)
    monkeypatch.setattr(served.services, "limiter", counting)
    started = time.monotonic()
    for _ in range(25):
        assert headroom(served, key)["remaining_requests"] == 5
        assert httpx.get(f"{served.url}/readyz", timeout=10).status_code == 200
    seconds = time.monotonic() - started
    assert counting.peeks <= 2 * (int(seconds) + 1), (counting.peeks, seconds)  # one per second per tenant
