"""Every request that reached an engine is billed exactly once with what the engine processed, whatever
moment its client leaves: during prefill (streaming or not), before a stream's first chunk is sent, or
mid-generation without streaming.

The app runs behind the behaviour Ray Serve's proxy has and uvicorn lacks: a client that disconnects
cancels its request's handler. The engine's steps are slowed (and announced) so that each moment is hit
for sure, not by luck of timing.
"""

import asyncio
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from billing.models import UsageEvent
from tests.app.conftest import MODEL, Served, serving
from tests.app.helpers import wait_for
from tests.app.test_metering import usage_rows
from tests.model_fixtures import TinySetup

DROP_AT_START = "x-test-drop-at-start"  # this request's client is gone when its response starts


class AsServeProxy:
    """ASGI middleware: the body is read up front, then a disconnect cancels the handler (as Serve does);
    with DROP_AT_START, sending the response start fails as on a closed connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        delivered = False

        async def app_receive() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the handler learns of a disconnect by being cancelled
            raise AssertionError("unreachable")

        drop = (DROP_AT_START.encode(), b"1") in scope["headers"]

        async def app_send(message: Message) -> None:
            if drop and message["type"] == "http.response.start":
                raise OSError("client gone")
            await send(message)

        handler = asyncio.ensure_future(self.app(scope, app_receive, app_send))

        async def cancel_on_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            handler.cancel()

        watcher = asyncio.ensure_future(cancel_on_disconnect())
        try:
            await handler
        except (asyncio.CancelledError, OSError):
            pass
        finally:
            watcher.cancel()


@pytest.fixture(scope="module")
def proxied(llama: TinySetup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(llama, tmp_path_factory.mktemp("abort-billing"), wrap=AsServeProxy) as app:
        yield app


class SlowSteps:
    """Each engine step takes at least `step_s` and is counted, so a test can act mid-prefill."""

    def __init__(self, served: Served, step_s: float) -> None:
        self.runner = served.engine._engine.runner
        self.inner = self.runner.run
        self.step_s = step_s
        self.steps = 0
        self.lock = threading.Lock()

    def __enter__(self) -> "SlowSteps":
        def run(*args: Any, **kwargs: Any) -> Any:
            out = self.inner(*args, **kwargs)
            time.sleep(self.step_s)
            with self.lock:
                self.steps += 1
            return out

        self.runner.run = run  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.runner.run = self.inner  # type: ignore[method-assign]

    def wait(self, steps: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.steps < steps:
            assert time.monotonic() < deadline, f"only {self.steps} engine steps ran"
            time.sleep(0.01)


def send_raw(served: Served, key: str, body: dict[str, object], *extra: str) -> socket.socket:
    """Send a request on a raw connection the test can drop at any moment."""
    payload = json.dumps(body).encode()
    host, port = served.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = [
        "POST /v1/completions HTTP/1.1",
        f"host: {host}",
        f"authorization: Bearer {key}",
        "content-type: application/json",
        f"content-length: {len(payload)}",
        *extra,
    ]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
    return sock


def leave(sock: socket.socket) -> None:
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def one_row(served: Served, tenant_id: str) -> UsageEvent:
    wait_for(lambda: len(usage_rows(served, tenant_id)) >= 1, timeout=20)
    time.sleep(0.3)  # a second row, were one wrongly written, would be there by now
    rows = usage_rows(served, tenant_id)
    assert len(rows) == 1, [(r.status, r.prompt_tokens, r.completion_tokens) for r in rows]
    return rows[0]


def engine_idle(served: Served) -> Callable[[], bool]:
    return lambda: served.engine.stats().running == 0 and served.engine.stats().waiting == 0


PROMPT = "word " * 400  # 400+ tokens: several 128-token prefill chunks


@pytest.mark.parametrize("stream", [True, False])
def test_leaving_during_prefill_bills_the_chunks_that_ran(proxied: Served, stream: bool) -> None:
    tenant_id, key = proxied.new_tenant(f"ab-p-{uuid.uuid4().hex[:8]}", tier="enterprise")
    with SlowSteps(proxied, step_s=0.3) as steps:
        sock = send_raw(proxied, key, {"model": MODEL, "prompt": PROMPT, "max_tokens": 50, "stream": stream})
        steps.wait(1)  # the first chunk ran; the prompt is not done
        leave(sock)
        row = one_row(proxied, tenant_id)
    wait_for(engine_idle(proxied))
    assert row.status == "aborted" and row.completion_tokens == 0
    assert 128 <= row.prompt_tokens < 400, row.prompt_tokens  # at least one chunk, not the whole prompt


def test_a_client_gone_when_the_stream_starts_is_billed(proxied: Served) -> None:
    tenant_id, key = proxied.new_tenant(f"ab-s-{uuid.uuid4().hex[:8]}", tier="enterprise")
    body = {"model": MODEL, "prompt": "tell me a story", "max_tokens": 200, "stream": True}
    sock = send_raw(proxied, key, body, f"{DROP_AT_START}: 1")
    try:
        row = one_row(proxied, tenant_id)
    finally:
        leave(sock)
    wait_for(engine_idle(proxied))
    assert row.status == "aborted"
    assert row.prompt_tokens > 0 and 1 <= row.completion_tokens < 200  # it had its first token, no more


def test_leaving_a_non_streaming_request_mid_generation_bills_its_tokens(
    proxied: Served, caplog: pytest.LogCaptureFixture
) -> None:
    tenant_id, key = proxied.new_tenant(f"ab-g-{uuid.uuid4().hex[:8]}", tier="enterprise")
    with SlowSteps(proxied, step_s=0.05) as steps, caplog.at_level(logging.INFO, logger="app.middleware"):
        body = {"model": MODEL, "prompt": "go", "max_tokens": 400, "temperature": 0}  # runs long, greedy
        sock = send_raw(proxied, key, body)
        steps.wait(10)  # one prefill step, then decodes
        leave(sock)
        row = one_row(proxied, tenant_id)
    wait_for(engine_idle(proxied))
    assert row.status == "aborted" and row.finish_reason == "abort"
    assert row.prompt_tokens > 0 and 5 <= row.completion_tokens < 400
    # Its handler was cancelled, as Serve reports a client that left: one ordinary line says so.
    assert [r.getMessage() for r in caplog.records] == [f"client disconnected (request {row.request_id})"]
