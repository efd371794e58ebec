"""ClosingStreamingResponse: a StreamingResponse whose cleanup runs however the response ends.

A stream's body generator cleans up in its own `finally`, but only once it started: a client that leaves
between the route returning the response and the first chunk (or while a chunk is being sent, with the
generator suspended) never runs it. `on_close` runs after the response in every case, and must be
idempotent (the generator's own cleanup may have run already).
"""

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app.completions.engine_stream import uncancellable


class ClosingStreamingResponse(StreamingResponse):
    def __init__(self, *args: Any, on_close: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await uncancellable(self.on_close())
