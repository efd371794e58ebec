"""BodyLimitMiddleware: request bodies over a limit are answered 413 before anything parses them.

A declared Content-Length over the limit is refused without reading a byte; a body sent without one
(chunked) is counted as it arrives and refused at the first byte past the limit. Adapter uploads have
their own, larger limit; every other route (the tenant API above all) gets the small one. FastAPI's own
`max_body_size` is not used: it replaces any response to such a request with a plain-text 413, so the
error would lose the OpenAI shape and the request id.
"""

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import APIError

UPLOAD_PATH = "/admin/adapters"


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"The request body is larger than this route accepts ({limit} bytes).", code="request_too_large"
    )


class BodyTooLarge(HTTPException):
    """Raised from `receive`: FastAPI passes HTTPExceptions from body reading through to the handlers."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, _too_large(limit).message)


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
            await _too_large(limit).response()(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(limit)
            return message

        await self.app(scope, counted, send)
