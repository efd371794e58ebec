"""Rate limits through HTTP: 429s with OpenAI's shape and retry hints, x-ratelimit headers on every admitted
response (streams before the first byte), token reconciliation, concurrency leases released on every end,
queue tiers in arrival order, the max_tokens cap, and a limiter outage (503, or fail-open)."""

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from app.limits import Decision, LimiterUnavailable, Limits, WindowState
from billing.models import Tier
from tests.app.conftest import MODEL, Served
from tests.app.helpers import wait_for


def make_tier(served: Served, **limits: object) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    with served.services.session_factory() as session, session.begin():
        session.add(Tier(name=name, description="test", **limits))
    return name


def tenant_key(served: Served, **limits: object) -> str:
    return served.new_tenant(f"rl-{uuid.uuid4().hex[:8]}", tier=make_tier(served, **limits))[1]


def complete(served: Served, key: str, **body: object) -> httpx.Response:
    payload = {"model": MODEL, "prompt": "hello there", "max_tokens": 2, "temperature": 0, **body}
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{served.url}/v1/completions", json=payload, headers=headers, timeout=60)


@contextmanager
def open_stream(served: Served, key: str, max_tokens: int = 300) -> Iterator[httpx.Response]:
    body = {"model": MODEL, "prompt": "go", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {key}"}) as response:  # fmt: skip
        yield response


def test_requests_per_minute(served: Served) -> None:
    key = tenant_key(served, rpm=3)
    ok = [complete(served, key) for _ in range(3)]
    assert [r.status_code for r in ok] == [200, 200, 200]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in ok] == ["2", "1", "0"]
    assert all(r.headers["x-ratelimit-limit-requests"] == "3" for r in ok)
    assert ok[0].headers["x-ratelimit-reset-requests"].endswith("s")
    refused = complete(served, key)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "invalid_request_error"
    assert "requests per minute" in error["message"]
    assert 0 < int(refused.headers["retry-after"]) <= 60
    assert 0 < int(refused.headers["retry-after-ms"]) <= 60_000
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"


def test_streams_carry_the_headers_before_the_first_byte(served: Served) -> None:
    key = tenant_key(served, rpm=10, tpm=100_000)
    with open_stream(served, key, max_tokens=4) as response:
        assert response.status_code == 200
        assert response.headers["x-ratelimit-limit-requests"] == "10"
        assert response.headers["x-ratelimit-limit-tokens"] == "100000"
        assert int(response.headers["x-ratelimit-remaining-tokens"]) < 100_000
        response.read()


def test_token_reservations_are_reconciled_to_real_usage(served: Served) -> None:
    free = complete(served, tenant_key(served), max_tokens=40).json()["choices"][0]["text"]
    stop = free[4:7]  # the output of this prompt stops here, after a few of its 40 tokens
    key = tenant_key(served, tpm=220)
    first = complete(served, key, max_tokens=200, stop=[stop])  # reserves prompt + 200 of the 220
    assert first.status_code == 200
    used = first.json()["usage"]["total_tokens"]
    assert used < 30
    # Had the 200-token reservation stayed, this one could not fit; reconciled, it does.
    second = complete(served, key, max_tokens=150)
    assert second.status_code == 200, second.text
    assert int(second.headers["x-ratelimit-remaining-tokens"]) == 220 - used - (
        second.json()["usage"]["prompt_tokens"] + 150
    )
    too_big = complete(served, key, max_tokens=500)
    assert too_big.status_code == 429 and too_big.json()["error"]["code"] == "request_too_large"
    assert too_big.headers["x-should-retry"] == "false"


def leases(served: Served, tenant_id: str) -> int:
    state = served.services.limiter.state._tenants.get(tenant_id)  # type: ignore[attr-defined]
    return 0 if state is None else len(state.leases)


def hold(served: Served, tenant_id: str, limits: Limits) -> str:
    """A lease taken as another ingress replica's running request would take it."""
    holder = f"other-replica-{uuid.uuid4().hex[:6]}"
    decision = asyncio.run(served.services.limiter.admit(tenant_id, holder, limits, 1))
    assert decision.admitted
    return holder


def test_concurrency_limit_and_the_lease_is_freed_on_every_end(served: Served) -> None:
    limits = Limits(max_concurrent=1)
    tenant_id, key = served.new_tenant(f"cc-{uuid.uuid4().hex[:8]}", tier=make_tier(served, max_concurrent=1))
    holder = hold(served, tenant_id, limits)
    busy = complete(served, key)
    assert busy.status_code == 429 and "concurrent" in busy.json()["error"]["message"]
    asyncio.run(served.services.limiter.release(tenant_id, holder, 1))

    assert complete(served, key).status_code == 200  # completed: released
    assert leases(served, tenant_id) == 0
    with open_stream(served, key, max_tokens=900) as running:  # client disconnects mid-stream
        assert running.status_code == 200
        next(line for line in running.iter_lines() if line.startswith("data: "))
    wait_for(lambda: leases(served, tenant_id) == 0)
    # An engine failure releases it too: an adapter whose files broke after upload.
    source = served.setup.adapter_dirs["demo-sql"]
    files = {
        "adapter_config": ("c.json", (source / "adapter_config.json").read_bytes()),
        "adapter_model": ("m.safetensors", (source / "adapter_model.safetensors").read_bytes()),
    }
    with served.admin() as admin:
        made = admin.post("/admin/adapters", data={"name": "fragile", "owner": tenant_id}, files=files).json()
    (served.services.store.root / made["id"] / "v1" / "adapter_model.safetensors").write_bytes(b"broken")
    failed = complete(served, key, model="fragile")
    assert failed.status_code == 503 and failed.json()["error"]["code"] == "model_unavailable"
    assert leases(served, tenant_id) == 0
    assert complete(served, key).status_code == 200


def test_queue_tier_waits_in_arrival_order_then_gives_up(served: Served) -> None:
    limits = Limits(max_concurrent=1, on_limit="queue", max_queue_ms=8000)
    tier = make_tier(served, max_concurrent=1, on_limit="queue", max_queue_ms=8000)
    tenant_id, key = served.new_tenant(f"q-{uuid.uuid4().hex[:8]}", tier=tier)
    holder = hold(served, tenant_id, limits)
    finished: list[int] = []

    def waiter(i: int) -> None:
        response = complete(served, key, max_tokens=3)
        assert response.status_code == 200, response.text
        finished.append(i)

    threads = [threading.Thread(target=waiter, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
        time.sleep(0.2)  # arrival order 0, 1, 2, all waiting behind the held lease
    assert finished == []
    asyncio.run(served.services.limiter.release(tenant_id, holder, 1))
    for thread in threads:
        thread.join(30)
    assert finished == [0, 1, 2]

    short = make_tier(served, max_concurrent=1, on_limit="queue", max_queue_ms=300)
    tenant_id, key = served.new_tenant(f"qs-{uuid.uuid4().hex[:8]}", tier=short)
    hold(served, tenant_id, Limits(max_concurrent=1))
    start = time.monotonic()
    timed_out = complete(served, key)
    waited = time.monotonic() - start
    assert timed_out.status_code == 429 and "waiting" in timed_out.json()["error"]["message"]
    assert 0.25 < waited < 3


def test_a_full_queue_refuses_at_once(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the tenant's waiter cap a queue tier answers 429 without waiting (issue 14)."""
    limits = Limits(max_concurrent=1, on_limit="queue", max_queue_ms=8000)
    tier = make_tier(served, max_concurrent=1, on_limit="queue", max_queue_ms=8000)
    tenant_id, key = served.new_tenant(f"qf-{uuid.uuid4().hex[:8]}", tier=tier)
    monkeypatch.setattr(served.services.limiter.waiting, "max_waiters", 1)  # type: ignore[attr-defined]
    holder = hold(served, tenant_id, limits)
    waiting = threading.Thread(target=lambda: complete(served, key, max_tokens=1))
    waiting.start()
    try:
        deadline = time.monotonic() + 10
        while asyncio.run(served.services.limiter.peek(tenant_id)).queued != 1:
            assert time.monotonic() < deadline, "the first waiter never queued"
            time.sleep(0.02)
        start = time.monotonic()
        refused = complete(served, key)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert time.monotonic() - start < 4  # not after its 8 s in the queue
        assert "waiting" not in refused.json()["error"]["message"]
        assert 1 <= int(refused.headers["retry-after"]) <= 60
    finally:
        asyncio.run(served.services.limiter.release(tenant_id, holder, 1))
        waiting.join(30)


def test_max_tokens_cap(served: Served) -> None:
    key = tenant_key(served, max_tokens_cap=8)
    over = complete(served, key, max_tokens=9)
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    headers = {"authorization": f"Bearer {key}"}
    absent = httpx.post(f"{served.url}/v1/chat/completions", headers=headers, json=body, timeout=60)
    assert absent.status_code == 200 and absent.json()["usage"]["completion_tokens"] <= 8
    # /v1/completions defaults to 16 tokens (as OpenAI): under a smaller cap the default is the cap.
    plain = {"model": MODEL, "prompt": "hi", "temperature": 0}
    default = httpx.post(f"{served.url}/v1/completions", headers=headers, json=plain, timeout=60)
    assert default.status_code == 200, default.text
    answer = default.json()
    assert answer["usage"]["completion_tokens"] == 8 or answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] <= 8


class DownLimiter:
    """The limiter backend during an outage: every call fails at once."""

    async def admit(self, *_: object, **__: object) -> Decision:
        raise LimiterUnavailable("connection refused")

    async def release(self, *_: object) -> None:
        raise LimiterUnavailable("connection refused")

    async def renew(self, tenant: str, request_id: str, limits: Limits) -> None:
        raise LimiterUnavailable("connection refused")

    async def leave_queue(self, tenant: str, request_id: str) -> None:
        raise LimiterUnavailable("connection refused")

    async def peek(self, tenant: str) -> WindowState:
        raise LimiterUnavailable("connection refused")


def test_limiter_outage_fails_closed_unless_configured_open(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = tenant_key(served, rpm=100)
    monkeypatch.setattr(served.services, "limiter", DownLimiter())
    closed = complete(served, key)
    assert closed.status_code == 503 and closed.json()["error"]["code"] == "rate_limiter_unavailable"
    assert closed.headers["retry-after"] == "1"
    monkeypatch.setattr(served.services, "limiter_fail_open", True)
    assert complete(served, key).status_code == 200
    unlimited = tenant_key(served)  # no limits: the limiter is not even asked
    monkeypatch.setattr(served.services, "limiter_fail_open", False)
    assert complete(served, unlimited).status_code == 200
    assert "x-ratelimit-limit-requests" not in complete(served, unlimited).headers
    assert json.loads(closed.text)["error"]["message"]
