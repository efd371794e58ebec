"""A request answered at its end (not streamed) asks the engine for whole outputs: the engine hands it one
output a choice instead of one a step, and its answer is the one the stream spells out token by token."""

import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import httpx
import pytest

from deployments.engine.interface import EngineClient
from deployments.engine.outputs import RequestOutput
from deployments.engine.request import EngineRequest
from tests.app.conftest import MODEL, Served


class Counting:
    """The real in-process engine, counting what each request asked for and how many outputs it got."""

    def __init__(self, inner: EngineClient) -> None:
        self.inner = inner
        self.requests: list[EngineRequest] = []
        self.outputs = 0

    async def generate(self, base_model: str, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        self.requests.append(request)
        async for output in self.inner.generate(base_model, request):
            self.outputs += 1
            yield output

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


BODY = {"model": MODEL, "prompt": "tell me", "max_tokens": 8, "temperature": 0, "n": 2, "logprobs": 2}


def post(served: Served, key: str, **more: object) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{served.url}/v1/completions", json={**BODY, **more}, headers=headers, timeout=60)


def test_a_non_streamed_request_gets_one_output_a_choice_with_what_the_stream_spells_out(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, key = served.new_tenant(f"w-{uuid.uuid4().hex[:8]}", tier="enterprise")
    counting = Counting(served.services.engine)
    monkeypatch.setattr(served.services, "engine", counting)

    reply = post(served, key)
    assert reply.status_code == 200, reply.text
    assert [r.whole for r in counting.requests] == [True]
    assert counting.outputs == 3  # the announcement, then each of the two choices once

    stream = post(served, key, stream=True)
    assert stream.status_code == 200
    assert [r.whole for r in counting.requests] == [True, False]
    assert counting.outputs > 3 + 2 * 8  # a step's output each
    events = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    for choice in reply.json()["choices"]:
        mine = [c for e in events for c in e["choices"] if c["index"] == choice["index"]]
        assert choice["text"] == "".join(c["text"] for c in mine) and choice["finish_reason"] == "length"
        streamed_tokens = [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]]
        assert choice["logprobs"]["tokens"] == streamed_tokens and len(streamed_tokens) == 8
