"""The only place where errors become HTTP: domain errors -> OpenAI error JSON with the right status.

`{"error": {"message", "type", "param", "code"}}`, as the OpenAI SDK expects it.
"""

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from adapters.errors import AdapterError, AdapterInvalid, AdapterNotFound
from billing.errors import (
    ApiKeyNotFound,
    BillingError,
    InvalidLimits,
    TenantNameTaken,
    TenantNotFound,
    TierNotFound,
)
from deployments.engine.errors import (
    EngineError,
    EngineOverloaded,
    EngineStopped,
    InvalidRequest,
    PromptTooLong,
)

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error that already knows its HTTP shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class InvalidApiKey(APIError):
    def __init__(self, message: str = "Incorrect API key provided.") -> None:
        super().__init__(401, message, code="invalid_api_key")


class AdminAuthFailed(APIError):
    def __init__(self, message: str) -> None:
        super().__init__(401, message, code="invalid_admin_key")


class ModelNotFound(APIError):
    def __init__(self, model: str) -> None:
        # The same words whether the model does not exist or belongs to another tenant: no hint either way.
        super().__init__(
            404,
            f"The model `{model}` does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )


def to_api_error(error: Exception) -> APIError:
    """Map a domain error to its HTTP form. Unknown errors become a 500 that reveals nothing."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, PromptTooLong):
        return APIError(400, str(error), param=error.param, code="context_length_exceeded")
    if isinstance(error, InvalidRequest):
        return APIError(400, str(error), param=error.param)
    if isinstance(error, EngineOverloaded | EngineStopped):
        message = f"The model is overloaded or restarting: {error}"
        return APIError(
            503, message, type="server_error", code="engine_unavailable", headers={"retry-after": "1"}
        )
    if isinstance(error, AdapterNotFound):
        return APIError(404, str(error), param="model", code="model_not_found")
    if isinstance(error, AdapterInvalid):
        return APIError(400, str(error), code="invalid_adapter")
    if isinstance(error, TenantNotFound | ApiKeyNotFound):
        return APIError(404, str(error), code="not_found")
    if isinstance(error, TenantNameTaken):
        return APIError(409, str(error), param="name", code="conflict")
    if isinstance(error, TierNotFound):
        return APIError(400, str(error), param="tier", code="tier_not_found")
    if isinstance(error, InvalidLimits):
        return APIError(400, str(error), param=error.field, code="invalid_limits")
    if isinstance(error, AdapterError | BillingError | EngineError):
        return APIError(400, str(error))
    if isinstance(error, OperationalError | InterfaceError):  # unreachable, refusing, or locked: transient
        log.warning("database unavailable: %s", error)
        message = "The platform's database is unavailable right now; please retry shortly."
        return APIError(
            503, message, type="server_error", code="database_unavailable", headers={"retry-after": "1"}
        )
    log.exception("unhandled error", exc_info=error)
    message = "The server had an error while processing your request."
    return APIError(500, message, type="server_error", code="internal_error")


def _validation_error(_: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    first = error.errors()[0] if error.errors() else {}
    kind = first.get("type", "")
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path")]
    param = None if kind == "json_invalid" else ".".join(loc) or None  # json errors locate a character
    if kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif kind == "json_invalid" or (kind == "model_attributes_type" and not loc):
        message = "We could not parse the JSON body of your request."
    else:
        message = (
            f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg", "invalid"))
        )
    return APIError(400, message, param=param).response()


def _http_error(_: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, StarletteHTTPException)
    kind = "invalid_request_error" if error.status_code < 500 else "server_error"
    return APIError(
        error.status_code, str(error.detail), type=kind, headers=dict(error.headers or {})
    ).response()


def install_error_handlers(app: FastAPI) -> None:
    def handler(_: Request, error: Exception) -> JSONResponse:
        return to_api_error(error).response()

    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for kind in (APIError, AdapterError, BillingError, EngineError):
        app.add_exception_handler(kind, handler)
    # Anything else is turned into a 500 by RequestContextMiddleware, which also stamps x-request-id on it.
