"""When the engine replica running a request is lost mid-generation (ReplicaLost from the Serve client), a
non-streaming request is run again and answered as if nothing happened; a stream, whose client already has
tokens, ends with a clear error event. Either way the request is metered once."""

import json
import uuid
from collections.abc import AsyncGenerator
from dataclasses import replace

import httpx
import pytest

from deployments.engine.errors import ReplicaLost
from deployments.engine.interface import EngineClient
from deployments.engine.outputs import RequestOutput
from deployments.engine.request import EngineRequest
from tests.app.conftest import MODEL, Served
from tests.app.helpers import wait_for
from tests.app.test_metering import usage_rows


class LosesFirstAttempts:
    """The real in-process engine, except that the first `losses` attempts lose their replica after
    `after` tokens (before the output that would bring more: a non-streamed request gets its tokens in one
    output), as the Serve client reports a replica that died mid-stream."""

    def __init__(self, inner: EngineClient, *, losses: int, after: int) -> None:
        self.inner, self.losses, self.after, self.attempts = inner, losses, after, 0

    async def generate(self, base_model: str, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        self.attempts += 1
        lose = self.attempts <= self.losses
        outputs = self.inner.generate(base_model, request)
        delivered = 0
        try:
            async for output in outputs:
                if lose and delivered + len(output.token_ids) > self.after:
                    raise ReplicaLost(request.request_id, delivered)
                delivered += len(output.token_ids)
                yield output
        finally:
            await outputs.aclose()

    async def abort(self, base_model: str, request_id: str, replica: str | None) -> bool:
        return await self.inner.abort(base_model, request_id, replica)


def complete(served: Served, key: str, **body: object) -> httpx.Response:
    payload = {"model": MODEL, "prompt": "tell me", "max_tokens": 8, "temperature": 0, **body}
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{served.url}/v1/completions", json=payload, headers=headers, timeout=60)


def stream_events(served: Served, key: str) -> list[str]:
    """A streamed completion's `data:` payloads; the stream itself must open with a 200."""
    body = {"model": MODEL, "prompt": "tell me", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {key}"}) as response:  # fmt: skip
        assert response.status_code == 200
        return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def test_a_non_streaming_request_is_restarted_and_metered_once(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant_id, key = served.new_tenant(f"f-{uuid.uuid4().hex[:8]}", tier="enterprise")
    expected = complete(served, key).json()["choices"][0]["text"]
    flaky = LosesFirstAttempts(served.services.engine, losses=2, after=3)
    monkeypatch.setattr(served.services, "engine", flaky)
    reply = complete(served, key)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == expected and flaky.attempts == 3
    wait_for(lambda: len(usage_rows(served, tenant_id)) == 2)
    rows = [r for r in usage_rows(served, tenant_id) if r.request_id == reply.json()["id"]]
    assert len(rows) == 1 and rows[0].status == "completed" and rows[0].completion_tokens == 8


def test_a_request_that_keeps_losing_replicas_gets_a_clear_503(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant_id, key = served.new_tenant(f"f-{uuid.uuid4().hex[:8]}", tier="enterprise")
    monkeypatch.setattr(
        served.services, "engine", LosesFirstAttempts(served.services.engine, losses=9, after=1)
    )
    reply = complete(served, key)
    assert reply.status_code == 503
    error = reply.json()["error"]
    assert error["code"] == "engine_unavailable" and "retry the request" in error["message"]
    wait_for(lambda: len(usage_rows(served, tenant_id)) == 1)
    assert usage_rows(served, tenant_id)[0].status == "failed"


def test_a_stream_that_loses_its_replica_ends_with_an_error_event(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant_id, key = served.new_tenant(f"f-{uuid.uuid4().hex[:8]}", tier="enterprise")
    monkeypatch.setattr(
        served.services, "engine", LosesFirstAttempts(served.services.engine, losses=1, after=3)
    )
    events = stream_events(served, key)
    assert "[DONE]" not in events
    *chunks, last = [json.loads(e) for e in events]
    assert len(chunks) == 3 and last["error"]["code"] == "engine_unavailable"
    wait_for(lambda: len(usage_rows(served, tenant_id)) == 1)
    (row,) = usage_rows(served, tenant_id)
    assert row.status == "failed" and row.completion_tokens >= 3


class LosesBeforeAnyText(LosesFirstAttempts):
    """As LosesFirstAttempts, but the lost attempts' outputs carry no text yet (a first token whose bytes
    the detokenizer still holds back): the stream has nothing to write before the loss."""

    async def generate(self, base_model: str, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        lose = self.attempts < self.losses
        async for output in super().generate(base_model, request):
            yield replace(output, text="") if lose and not output.accepted else output


def test_a_stream_lost_before_its_first_event_runs_again_and_completes(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant_id, key = served.new_tenant(f"f-{uuid.uuid4().hex[:8]}", tier="enterprise")
    expected = complete(served, key).json()["choices"][0]["text"]
    flaky = LosesBeforeAnyText(served.services.engine, losses=1, after=1)
    monkeypatch.setattr(served.services, "engine", flaky)
    events = stream_events(served, key)
    assert events[-1] == "[DONE]" and flaky.attempts == 2
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    wait_for(lambda: len(usage_rows(served, tenant_id)) == 2)
    rows = [r for r in usage_rows(served, tenant_id) if r.request_id == chunks[0]["id"]]
    assert len(rows) == 1 and rows[0].status == "completed" and rows[0].completion_tokens == 8
