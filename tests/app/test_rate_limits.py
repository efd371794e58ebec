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
from typing import Any

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


def hold(served: Served, tenant_id: str, limits: Limits, reserve: int = 1) -> str:
    """A lease taken as another ingress replica's running request would take it."""
    holder = f"other-replica-{uuid.uuid4().hex[:6]}"
    decision = asyncio.run(served.services.limiter.admit(tenant_id, holder, limits, reserve))
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
    served.break_adapter(made["id"])
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
    for arrived, thread in enumerate(threads, start=1):
        thread.start()
        # Arrival order 0, 1, 2, all waiting behind the held lease: the next starts once this one
        # queued (a fixed sleep let a loaded CI machine reorder the arrivals themselves).
        deadline = time.monotonic() + 10
        while asyncio.run(served.services.limiter.peek(tenant_id)).queued != arrived:
            assert time.monotonic() < deadline, f"waiter {arrived - 1} never queued"
            time.sleep(0.02)
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


class CountingAdmits:
    """The app's limiter, counting the admit calls that reach it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.admits = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def admit(self, *args: Any, **kwargs: Any) -> Decision:
        self.admits += 1
        decision: Decision = await self.inner.admit(*args, **kwargs)
        return decision


def post_raw(served: Served, key: str, path: str, content: bytes) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    return httpx.post(f"{served.url}{path}", content=content, headers=headers, timeout=60)


def bad_bodies() -> list[tuple[str, bytes]]:
    """Bodies that are refused 400 when parsed: not JSON, and a large schema-invalid list of messages."""
    items = json.dumps([{"role": "user", "content": "x", "junk": [1] * 8}] * 12_000).encode()
    return [
        ("/v1/completions", b"{not json"),
        ("/v1/chat/completions", b'{"model": "' + MODEL.encode() + b'", "messages": ' + items + b", 7}"),
        ("/v1/chat/completions", b'{"model": 1, "messages": ' + items + b"}"),
        ("/v1/responses", b'{"model": 1, "input": ' + items + b"}"),
    ]


def assert_rpm_refusal(response: httpx.Response) -> None:
    assert response.status_code == 429, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "requests per minute" in error["message"]
    assert 1 <= int(response.headers["retry-after"]) <= 60
    assert 0 < int(response.headers["retry-after-ms"]) <= 60_000
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    assert response.headers["x-request-id"]


def test_a_tenant_over_its_rpm_is_refused_before_its_body_is_parsed(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35, item 2: after a requests-per-minute refusal (reject tier) the tenant's next requests, for a
    moment, get the same 429 before their bodies are parsed and without a limiter call each."""
    key = tenant_key(served, rpm=1)
    other = tenant_key(served, rpm=50)
    counting = CountingAdmits(served.services.limiter)
    monkeypatch.setattr(served.services, "limiter", counting)
    assert complete(served, key).status_code == 200
    assert_rpm_refusal(complete(served, key))
    assert counting.admits == 2
    for path, body in bad_bodies():  # each a 400 once parsed; refused first, unread and unparsed
        assert_rpm_refusal(post_raw(served, key, path, body))
    assert_rpm_refusal(complete(served, key))
    assert counting.admits == 2  # a refused flood costs no limiter round trip
    # Reads are not admissions: they stay free of it.
    models = httpx.get(f"{served.url}/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=30)
    assert models.status_code == 200
    # Another tenant is untouched: its bad body is parsed and refused for itself, its good one admitted.
    assert post_raw(served, other, "/v1/completions", b"{not json").status_code == 400
    assert complete(served, other).status_code == 200
    assert counting.admits == 4  # the bad body counted against its RPM, the good one admitted
    time.sleep(1.2)  # past the hold (at most a second): the limiter is asked again
    assert_rpm_refusal(complete(served, key))
    assert counting.admits == 5
    assert_rpm_refusal(post_raw(served, key, "/v1/completions", b"{not json"))
    assert counting.admits == 5


def test_bad_requests_that_fill_the_rpm_stop_the_next_parse(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused requests count against RPM; once they have filled it, the next is refused unparsed."""
    key = tenant_key(served, rpm=2)
    counting = CountingAdmits(served.services.limiter)
    monkeypatch.setattr(served.services, "limiter", counting)
    for _ in range(3):  # two counted, the third refused by the limiter (its answer stays the 400)
        assert post_raw(served, key, "/v1/completions", b"{not json").status_code == 400
    assert counting.admits == 3
    assert_rpm_refusal(post_raw(served, key, "/v1/completions", b"{not json"))
    assert_rpm_refusal(complete(served, key))
    assert counting.admits == 3


def test_queue_tiers_and_token_refusals_are_not_kept(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue tier's request waits for room (no refusal is kept for it); a token refusal depends on the
    body, so the next request is parsed and asks the limiter."""
    queued = tenant_key(served, rpm=1, on_limit="queue", max_queue_ms=200)
    tenant_id, tokens = served.new_tenant(
        f"rl-{uuid.uuid4().hex[:8]}", tier=make_tier(served, rpm=100, tpm=100)
    )
    hold(served, tenant_id, Limits(rpm=100, tpm=100), reserve=90)  # another replica's request holds 90
    counting = CountingAdmits(served.services.limiter)
    monkeypatch.setattr(served.services, "limiter", counting)
    assert complete(served, queued).status_code == 200
    waited = complete(served, queued)
    assert waited.status_code == 429 and "waiting" in waited.json()["error"]["message"]
    assert post_raw(served, queued, "/v1/completions", b"{not json").status_code == 400
    assert counting.admits == 3  # the bad body was parsed, and counted
    refused = complete(served, tokens, max_tokens=20)
    assert refused.status_code == 429 and "tokens per minute" in refused.json()["error"]["message"]
    assert complete(served, tokens, max_tokens=2).status_code == 200
    assert counting.admits == 5
