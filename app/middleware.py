"""RequestContextMiddleware: every response, errors and streams included, carries `x-request-id`.

The request id that reaches the engine and billing is always ours (`req_...`): a caller-chosen id could
collide with another tenant's running request, or be replayed to dodge a usage row keyed by it. A valid
`x-request-id` from the caller is kept only as the trace id we echo back.

A pure ASGI middleware (BaseHTTPMiddleware buffers and breaks streaming). It also turns any exception
that escaped the routes into the OpenAI 500 shape, because Starlette's own last-resort handler sits
outside the middleware stack and would drop the header. It binds both ids to the log context, so every log
line of the request carries them, and logs one "client disconnected" line for a client that left before
its response was complete (mid-body or mid-stream), however the server reports it: an `http.disconnect`
message, Starlette's ClientDisconnect, or the handler cancelled (Ray Serve's way). An ordinary event,
never a traceback.
"""

import asyncio
import logging
import re
import uuid
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import log_context
from app.errors import to_api_error

log = logging.getLogger(__name__)
_VALID_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, *, emit_header: bool = True) -> None:
        self.app = app
        # Behind Ray Serve the proxy already adopts the client's id (or makes one), passes it in the
        # request headers and stamps the response: here we only read it, else the header doubles.
        self.emit_header = emit_header

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = new_request_id()
        trace_id = incoming if _VALID_ID.match(incoming) else request_id
        scope.setdefault("state", {}).update(request_id=request_id, trace_id=trace_id)
        started = finished = gone = False

        def client_gone() -> None:
            nonlocal gone
            if not gone and not finished:
                log.info("client disconnected (request %s)", request_id)
            gone = True

        async def receive_watching() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect":
                client_gone()
            return message

        async def send_with_id(message: Message) -> None:
            nonlocal started, finished
            if message["type"] == "http.response.start":
                started = True
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            if message["type"] == "http.response.start" and self.emit_header:
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", trace_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        bound = log_context.bind(request_id=request_id, trace_id=trace_id)
        try:
            await self.app(scope, receive_watching, send_with_id)
        except ClientDisconnect:  # the client went away mid-request: nobody to answer
            client_gone()
        except asyncio.CancelledError:
            client_gone()
            raise
        except Exception as error:
            if started:  # mid-stream: the body already began; nothing left to do but log
                log.exception("error after the response started (request %s)", request_id)
                return
            response = to_api_error(error).response()
            await response(scope, receive, send_with_id)
        finally:
            log_context.reset(bound)


def request_id_of(scope_state: dict[str, Any]) -> str:
    return str(scope_state.get("request_id") or new_request_id())
