"""BodyLimitMiddleware: request bodies over a limit are answered 413 before anything parses them.

A declared Content-Length over the limit is refused without reading a byte. A body sent without one
(chunked) is read here up to the limit and refused at the first byte past it; FastAPI reads whole bodies
anyway, so buffering them first costs nothing. Uploads (adapters at POST /admin/adapters, files at POST
/v1/files) have their own, larger limits and stream to disk under them (app/upload.py): only their declared
length is checked here. FastAPI's own `max_body_size`
is not used: it replaces any response to such a request with a plain-text 413, so the error would lose
the OpenAI shape and the request id.
"""

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import BodyTooLarge

ADAPTER_UPLOAD_PATH = "/admin/adapters"
FILE_UPLOAD_PATH = "/v1/files"


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int, upload_limits: dict[str, int]) -> None:
        """`upload_limits`: the path of each streamed upload (POST) and the largest body it takes."""
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.upload_limits = upload_limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload_limit = (
            self.upload_limits.get(scope["path"].rstrip("/")) if scope["method"] == "POST" else None
        )
        is_upload = upload_limit is not None
        limit = upload_limit if upload_limit is not None else self.max_body_bytes
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
