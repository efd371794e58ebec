"""A client that stops reading a stream keeps its concurrency slot until the stream is delivered.

Under Ray Serve the ingress replica's ASGI `send` never blocks: it queues each message for the proxy,
which writes them to the client as the socket accepts them. So the replica's stream runs to its end
while its output waits for the client. `AsServeReplica` puts the app behind that same shape (an
unbounded queue to a pump that writes to the real connection); the lease must stay held until uvicorn
has written the whole response (its `receive` then answers `http.disconnect`, as Serve's proxy relays).
"""

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.limits import Limits
from tests.app.conftest import MODEL, Served, serving
from tests.app.helpers import wait_for
from tests.app.test_abort_billing import send_raw
from tests.app.test_limits_api import new_key
from tests.model_fixtures import TinySetup


class AsServeReplica:
    """The app's `send` never blocks (the replica's queue); a pump writes what it queued to the
    connection while the client reads (the proxy): `reading` cleared, the pump waits, as the proxy's
    write waits on a client that stopped reading (a test cannot fill loopback's socket buffers for sure)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.reading = threading.Event()
        self.queued_bytes = 0  # what the app sent that the connection has not taken yet
        self.ended = False  # the app sent its last body message

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        queue: asyncio.Queue[Message | None] = asyncio.Queue()

        async def pump() -> None:
            while (message := await queue.get()) is not None:
                while not self.reading.is_set():
                    await asyncio.sleep(0.01)
                await send(message)
                self.queued_bytes -= len(message.get("body", b""))

        async def app_send(message: Message) -> None:
            self.queued_bytes += len(message.get("body", b""))
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self.ended = True
            queue.put_nowait(message)

        pumping = asyncio.ensure_future(pump())
        try:
            await self.app(scope, receive, app_send)
        finally:
            queue.put_nowait(None)
            await pumping


@pytest.fixture(scope="module")
def replica() -> AsServeReplica:
    return AsServeReplica(lambda scope, receive, send: None)  # type: ignore[arg-type,return-value]


@pytest.fixture(scope="module")
def proxied(
    llama: TinySetup, tmp_path_factory: pytest.TempPathFactory, replica: AsServeReplica
) -> Iterator[Served]:
    def wrap(app: ASGIApp) -> ASGIApp:
        replica.app = app
        return replica

    with serving(llama, tmp_path_factory.mktemp("slow-reader"), wrap=wrap) as app:
        yield app


def test_a_client_that_stops_reading_keeps_its_stream_counted(
    proxied: Served, replica: AsServeReplica
) -> None:
    replica.reading.set()
    tenant_id, key = new_key(proxied, max_concurrent=2)
    replica.reading.clear()  # the client stops reading
    replica.ended = False
    body = {
        "model": MODEL,
        "prompt": "go",
        "max_tokens": 200,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    sock = send_raw(proxied, key, body)
    limiter = proxied.services.limiter
    try:
        # The stream runs to its end and is billed, its whole output queued for the client...
        wait_for(lambda: replica.ended, timeout=60)
        assert replica.queued_bytes > 20_000
        # ...and the tenant's concurrency still counts the open stream.
        time.sleep(0.5)
        assert asyncio.run(limiter.peek(tenant_id)).in_flight == 1
        # It is marked as being delivered: a request it alone keeps out waits for it, briefly, on a
        # tier that rejects (its client may have read it all and sent that request at once).
        probe = asyncio.run(limiter.admit(tenant_id, "probe", Limits(max_concurrent=1), 0))
        assert probe.reason == "delivering"
        replica.reading.set()
        received = b""
        sock.settimeout(30)
        while not received.endswith(b"0\r\n\r\n") and (chunk := sock.recv(65536)):
            received += chunk
        assert b"data: [DONE]" in received
        wait_for(lambda: asyncio.run(limiter.peek(tenant_id)).in_flight == 0)  # delivered: freed
    finally:
        replica.reading.set()
        sock.close()
