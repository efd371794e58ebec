"""Metering through HTTP: every request that reached the engine becomes exactly one usage row with what
the engine measured, whether it completed, was aborted by the client or failed; nothing is lost while
metering is down, and nothing is counted twice."""

import asyncio
import time
import uuid

import httpx
import pytest
from sqlalchemy import select

from billing.models import UsageEvent
from billing.usage import UsageRecord
from tests.app.conftest import MODEL, Served
from tests.app.helpers import wait_for


def usage_rows(served: Served, tenant_id: str) -> list[UsageEvent]:
    with served.services.session_factory() as session:
        query = select(UsageEvent).where(UsageEvent.tenant_id == tenant_id).order_by(UsageEvent.started_at)
        return list(session.scalars(query))


def post(served: Served, key: str, path: str, body: dict[str, object]) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{served.url}{path}", json=body, headers=headers, timeout=60)


def test_a_completed_request_is_one_row_with_the_engines_numbers(served: Served) -> None:
    tenant_id, key = served.new_tenant(f"m-{uuid.uuid4().hex[:8]}", tier="enterprise")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    reply = post(served, key, "/v1/chat/completions", body).json()
    wait_for(lambda: len(usage_rows(served, tenant_id)) == 1)
    (row,) = usage_rows(served, tenant_id)
    assert row.request_id == reply["id"] and row.status == "completed" and row.finish_reason == "length"
    assert row.prompt_tokens == reply["usage"]["prompt_tokens"]
    assert row.completion_tokens == reply["usage"]["completion_tokens"] == 5
    assert row.cached_tokens == reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert row.gpu_ms > 0 and row.latency_ms >= row.queue_ms >= 0 and row.ttft_ms is not None
    assert row.model == MODEL and row.base_model == MODEL and row.adapter_id is None and row.replica
    assert row.finished_at >= row.started_at


def test_streamed_aborted_and_failed_requests_are_metered_too(served: Served) -> None:
    tenant_id, key = served.new_tenant(f"m-{uuid.uuid4().hex[:8]}", tier="enterprise")
    body = {"model": MODEL, "prompt": "go", "max_tokens": 900, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {key}"}) as response:  # fmt: skip
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 5:
                break  # the client goes away
    source = served.setup.adapter_dirs["demo-sql"]
    files = {
        "adapter_config": ("c.json", (source / "adapter_config.json").read_bytes()),
        "adapter_model": ("m.safetensors", (source / "adapter_model.safetensors").read_bytes()),
    }
    with served.admin() as admin:
        made = admin.post("/admin/adapters", data={"name": "broken", "owner": tenant_id}, files=files).json()
    served.break_adapter(made["id"])
    failed = post(served, key, "/v1/completions", {"model": "broken", "prompt": "x", "max_tokens": 2})
    assert failed.status_code == 503  # a registered adapter the engine cannot read is the platform's fault
    assert failed.headers.get("retry-after") and made["id"] not in failed.text
    wait_for(lambda: {r.status for r in usage_rows(served, tenant_id)} == {"aborted", "failed"})
    rows = {r.status: r for r in usage_rows(served, tenant_id)}
    assert (
        rows["aborted"].completion_tokens >= 4 and rows["aborted"].gpu_ms > 0
    )  # what the client got, at least
    assert rows["failed"].adapter_id == made["id"] and rows["failed"].adapter_version == 1


def test_nothing_is_lost_while_metering_is_down_and_nothing_is_counted_twice(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant_id, key = served.new_tenant(f"m-{uuid.uuid4().hex[:8]}", tier="enterprise")
    delivery = served.services.delivery
    real_sink = delivery.sink

    class Down:
        async def record(self, records: list[UsageRecord]) -> int:
            raise ConnectionError("metering unreachable")

    monkeypatch.setattr(delivery, "sink", Down())
    ids = [post(served, key, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 1}).json()["id"]
           for _ in range(5)]  # fmt: skip
    time.sleep(0.5)
    assert usage_rows(served, tenant_id) == []
    assert served.services.delivery.outbox.pending() >= 5  # kept on disk
    monkeypatch.setattr(delivery, "sink", real_sink)
    delivery.wake()
    wait_for(lambda: len(usage_rows(served, tenant_id)) == 5, timeout=40)  # after the backoff
    assert sorted(r.request_id for r in usage_rows(served, tenant_id)) == sorted(ids)

    # The same records delivered again (a retried batch after a lost acknowledgement) change nothing.
    rows = usage_rows(served, tenant_id)
    again = [UsageRecord(**{c: getattr(r, c) for c in UsageRecord.__dataclass_fields__}) for r in rows]
    assert asyncio.run(real_sink.record(again)) == 0
    assert len(usage_rows(served, tenant_id)) == 5
