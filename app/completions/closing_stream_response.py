"""ClosingStreamingResponse: a StreamingResponse whose cleanup runs however the response ends.

A stream's body generator cleans up in its own `finally`, but only once it started: a client that leaves
between the route returning the response and the first chunk (or while a chunk is being sent, with the
generator suspended) never runs it. `on_close` runs after the response in every case, and must be
idempotent (the generator's own cleanup may have run already).

Under Serve, `send` never blocks: the replica queues each message for the proxy and goes on, so a stream
"ends" here long before a slow client has read it, its output parked in the proxy. The one sign that the
proxy has written the whole response to the client's socket is `receive()` answering `http.disconnect`:
the proxy's server (uvicorn) answers it once the final body message is written, which waits for its
transport buffer to drain. So after the body, the response waits for that acknowledgement (at most
`DELIVERY_WAIT_S`) before `on_close`, which frees the tenant's concurrency lease: a client that stops
reading keeps its stream counted, and a tenant parks at most its concurrency limit of streams.
"""

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app.completions.engine_stream import uncancellable

# Longest wait for the proxy to deliver a finished stream. Set the load balancer's write-idle timeout
# (docs/cluster) below it: past it, the proxy still holds what the client did not read until the
# balancer drops the connection, but the tenant's lease is free.
DELIVERY_WAIT_S = 600.0


async def delivered(receive: Receive, wait_s: float = DELIVERY_WAIT_S) -> bool:
    """Wait until the server says the response went out (`http.disconnect`); False after `wait_s`, or
    when `receive` fails (the proxy is gone: nothing is left to deliver)."""
    with anyio.move_on_after(wait_s):
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:
            return False
        return True
    return False


class ClosingStreamingResponse(StreamingResponse):
    def __init__(self, *args: Any, on_close: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
            await delivered(receive)
        finally:
            await uncancellable(self.on_close())
