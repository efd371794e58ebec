"""BodyLimitMiddleware: request bodies over a limit are answered 413 before anything parses them.

A declared Content-Length over the limit is refused without reading a byte. A body sent without one
(chunked) is read here up to the limit and refused at the first byte past it; FastAPI reads whole bodies
anyway, so buffering them first costs nothing. Adapter uploads have their own, larger limit and stream to
disk under it (app/upload.py): only their declared length is checked here. FastAPI's own `max_body_size`
is not used: it replaces any response to such a request with a plain-text 413, so the error would lose
the OpenAI shape and the request id.
"""

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import BodyTooLarge

UPLOAD_PATH = "/admin/adapters"


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int, max_upload_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_upload_bytes = max_upload_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        is_upload = scope["method"] == "POST" and scope["path"].rstrip("/") == UPLOAD_PATH
        limit = self.max_upload_bytes if is_upload else self.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await BodyTooLarge(limit).response()(scope, receive, send)
            return
        if is_upload or declared is not None:  # within its declared length: the server enforces that
            await self.app(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left mid-body
                return
            body += message.get("body", b"")
            if len(body) > limit:
                await BodyTooLarge(limit).response()(scope, receive, send)
                return
            if not message.get("more_body"):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
