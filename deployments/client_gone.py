"""ClientGone: ASGI middleware that turns Serve's "the client left" into the message ASGI apps expect.

When an HTTP client disconnects, Serve's proxy cancels the ingress's request, and the replica's `receive`
raises TaskCancelledError instead of returning `http.disconnect`. Starlette's streaming responses listen
on `receive` while they stream, so each normal disconnect surfaced as an error traceback mid-response.
Returned as `http.disconnect`, it ends the response the way any disconnect does: the stream's cleanup
stops and bills the engine request, and app/middleware.py logs one ordinary "client disconnected" line
(as it does when Serve cancels the handler first, the other way the same disconnect arrives).
"""

from ray.exceptions import TaskCancelledError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DISCONNECT: Message = {"type": "http.disconnect"}


class ClientGone:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def receive_or_gone() -> Message:
            try:
                return await receive()
            except TaskCancelledError:
                return DISCONNECT

        await self.app(scope, receive_or_gone, send)
