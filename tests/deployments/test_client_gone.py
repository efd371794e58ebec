"""A client that leaves mid-stream behind Serve: the ingress's `receive` raises TaskCancelledError (the proxy
cancelled the request). ClientGone makes that the `http.disconnect` it means, so the log has one ordinary
"client disconnected" line for the request instead of an error traceback. Driven here through the real
app and engine (no Ray), with a `receive` that fails the way Serve's does."""

import asyncio
import json
import logging
from collections.abc import Iterator

import pytest
from ray.exceptions import TaskCancelledError
from starlette.types import ASGIApp, Message

from app.main import create_app
from deployments.client_gone import ClientGone
from tests.app.conftest import MODEL, Served, serving
from tests.model_fixtures import TinySetup


@pytest.fixture(scope="module")
def served(llama: TinySetup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(llama, tmp_path_factory.mktemp("client-gone")) as app:
        yield app


async def stream_then_leave(app: ASGIApp, key: str) -> list[Message]:
    """POST a streaming completion; once its first chunk arrived, the client is gone."""
    body = json.dumps({"model": MODEL, "prompt": "go", "max_tokens": 200, "stream": True}).encode()
    headers = [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "",
        "query_string": b"", "headers": headers, "client": ("127.0.0.1", 40000), "server": ("test", 80),
    }  # fmt: skip
    sent: list[Message] = []
    first_chunk = asyncio.Event()
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await first_chunk.wait()
        raise TaskCancelledError(error_message="the proxy cancelled the request")  # as Serve's receive

    async def send(message: Message) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and b"data: {" in message.get("body", b""):
            first_chunk.set()

    await asyncio.wait_for(app(scope, receive, send), timeout=60)
    return sent


def test_a_client_leaving_mid_stream_is_one_ordinary_log_line(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    _, key = served.new_tenant("leaves-early")
    app = ClientGone(create_app(served.services, behind_serve_proxy=True))
    with caplog.at_level(logging.INFO):
        sent = asyncio.run(stream_then_leave(app, key))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    chunks = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    request_id = json.loads(chunks.split(b"data: ", 2)[1].split(b"\n", 1)[0])["id"]
    assert "[DONE]" not in chunks.decode()  # it really left mid-stream
    gone = [r for r in caplog.records if r.getMessage() == f"client disconnected (request {request_id})"]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO
    # Before: "error after the response started" with the TaskCancelledError traceback.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
