"""The only place where errors become HTTP: domain errors -> OpenAI error JSON with the right status.

`{"error": {"message", "type", "param", "code"}}`, as the OpenAI SDK expects it. The rest of app/ raises
either domain errors (engine, adapters, billing, the limiter), mapped by `to_api_error`, or one of the named
gateway errors below; no other module chooses a status code (tests/test_architecture.py checks it).
"""

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from adapters.errors import (
    AdapterError,
    AdapterInvalid,
    AdapterLoadFailed,
    AdapterNotFound,
    AdapterStoreUnavailable,
    AdapterStoreUnsafe,
)
from app.limits import Decision, InvalidTokenCount, LimiterUnavailable, Limits
from billing.errors import (
    ApiKeyNotFound,
    BillingError,
    InvalidLimits,
    TenantNameTaken,
    TenantNotFound,
    TierNotFound,
)
from billing.schema_gate import DatabaseNotMigrated
from deployments.engine.interface import (
    BudgetTooSmall,
    EngineError,
    EngineOverloaded,
    EngineStopped,
    InvalidRequest,
    PromptTooLong,
    QueueShareExceeded,
    ReplicaLost,
    RequestFailed,
)

log = logging.getLogger(__name__)


MAX_MESSAGE_CHARS = 8192  # room for a list of every problem an upload has
MAX_PARAM_CHARS = 200


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[: limit - 1]}…"


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
        # Messages and params may quote what the caller sent (a field name, a model name): bounded, so an
        # error never echoes a megabyte back, nor carries it into the logs.
        message, param = (
            _clip(message, MAX_MESSAGE_CHARS),
            None if param is None else _clip(param, MAX_PARAM_CHARS),
        )
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


class InvalidParameter(APIError):
    """400: the request itself is wrong; `param` names the field to fix."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(400, message, param=param, code=code)


class NotFound(APIError):
    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(404, message, param=param, code="not_found")


class Conflict(APIError):
    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(409, message, param=param, code="conflict")


class PayloadTooLarge(APIError):
    def __init__(self, message: str, *, code: str) -> None:
        # `connection: close` makes uvicorn drop the connection after the 413; otherwise it would keep
        # reading (and discarding) the rest of a hostile multi-GB body to reuse the connection.
        super().__init__(413, message, code=code, headers={"connection": "close"})


_LIMIT_NAMES = {
    "requests": "requests per minute (RPM): limit {limit}",
    "tokens": "tokens per minute (TPM): limit {limit}",
    "concurrency": "concurrent sequences (each request counts n x prompts): limit {limit}",
    "queued": "queued requests: the wait ran out behind earlier ones",
    "queue_full": "queued requests: this tenant has the most queued that it may",
}


class RateLimited(APIError):
    def __init__(self, decision: Decision, limits: Limits, tier: str, *, queued_ms: int = 0) -> None:
        reason = decision.reason or "requests"
        limit = {"requests": limits.rpm, "tokens": limits.tpm, "concurrency": limits.max_concurrent}.get(
            reason
        )
        what = _LIMIT_NAMES.get(reason, "rate limit").format(limit=limit)
        waited = f" after waiting {queued_ms} ms in the queue" if queued_ms else ""
        retry_s = decision.retry_after_ms / 1000
        headers = {
            **decision.headers(),
            "retry-after": str(max(1, math.ceil(retry_s))),
            "retry-after-ms": str(decision.retry_after_ms),
        }
        message = f"Rate limit reached for {what} on tier {tier}{waited}. Please try again in {retry_s:g}s."
        super().__init__(429, message, code="rate_limit_exceeded", headers=headers)


class InsufficientQuota(APIError):
    """429 insufficient_quota (OpenAI's code): the request's worst case does not fit the tenant's credit or
    a hard spend limit. Retrying cannot help until the credit or the limit changes, so SDKs are told not to
    (`x-should-retry: false`)."""

    def __init__(
        self, limit: str, *, needed: str, remaining: str, currency: str, headers: dict[str, str]
    ) -> None:
        message = (
            f"You exceeded your {limit}: this request may cost up to {needed} {currency.upper()} and "
            f"{remaining} {currency.upper()} remain. Add credit or raise the limit, then retry."
        )
        super().__init__(
            429, message, code="insufficient_quota", headers={**headers, "x-should-retry": "false"}
        )


class StorageQuotaExceeded(APIError):
    """403 storage_quota_exceeded: storing this response would take the tenant past its tier's quota of
    stored responses (max_stored_response_bytes). The same request with store false is served; deleting
    stored responses, or their expiry, frees room."""

    def __init__(self, *, used: int, needed: int, quota: int, tier: str) -> None:
        message = (
            f"Storing this response would exceed your storage quota (max_stored_response_bytes of tier "
            f"{tier}: {quota:,} bytes; {used:,} in use or held by your requests in flight, this response "
            f"may need {needed:,}). Send store "
            "false, or delete stored responses (DELETE /v1/responses/{id}) or files (DELETE /v1/files/{id}) "
            "and retry."
        )
        super().__init__(
            403, message, param="store", code="storage_quota_exceeded", headers={"x-should-retry": "false"}
        )


class FileQuotaExceeded(APIError):
    """403 storage_quota_exceeded for an upload: the file would take the tenant past its tier's quota of
    stored bytes (max_stored_response_bytes), which its files share with its stored responses."""

    def __init__(self, *, used: int, needed: int, quota: int, tier: str) -> None:
        message = (
            f"This file would exceed your storage quota (max_stored_response_bytes of tier {tier}: "
            f"{quota:,} bytes, shared by stored responses and files; {used:,} in use, the file needs "
            f"{needed:,}). Delete files (DELETE /v1/files/{{id}}) or stored responses and retry."
        )
        super().__init__(
            403, message, param="file", code="storage_quota_exceeded", headers={"x-should-retry": "false"}
        )


class BatchLimitExceeded(APIError):
    """429 batch_limit_exceeded: the tenant has as many unfinished batches as it may (Settings.batches)."""

    def __init__(self, limit: int) -> None:
        message = (
            f"You have {limit:,} batches that are not finished, the most you may have at once; wait for one "
            "to finish or cancel one (POST /v1/batches/{id}/cancel), then retry."
        )
        super().__init__(429, message, code="batch_limit_exceeded", headers={"x-should-retry": "false"})


class BudgetUnavailable(APIError):
    """503: the tenant has a budget and the state that enforces it cannot be reached. Budgets fail closed
    whatever the rate limiter's fail_open says: money is never spent unchecked."""

    def __init__(self) -> None:
        super().__init__(
            503,
            "Spend limits cannot be checked right now; please retry shortly.",
            type="server_error",
            code="budget_unavailable",
            headers={"retry-after": "1"},
        )


class TooManySequences(InvalidParameter):
    """400: a request runs more sequences (every choice of every prompt) than it ever may; retrying the same
    request cannot help, so it is refused at once rather than queued."""

    def __init__(
        self, sequences: int, limit: str, *, n: int | None = None, prompts: int | None = None
    ) -> None:
        what = f"{sequences} sequences (n x prompts)"
        if n is not None and prompts is not None:
            what = f"n ({n}) x prompts ({prompts}) = {sequences} sequences"
        message = f"This request needs {what}; {limit}. Lower n or send fewer prompts."
        super().__init__(message, param="n", code="too_many_sequences")


class RequestTooLarge(APIError):
    def __init__(self, reserve: int, limits: Limits, tier: str) -> None:
        message = (
            f"Request too large: it may use {reserve} tokens (prompt + max_tokens), more than the "
            f"{limits.tpm} tokens per minute of tier {tier}. Lower max_tokens or shorten the prompt."
        )
        # Retrying cannot help: tell the OpenAI SDK not to.
        super().__init__(429, message, code="request_too_large", headers={"x-should-retry": "false"})


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        message = f"The request body is larger than this route accepts ({limit} bytes)."
        super().__init__(413, message, code="request_body_too_large")


class GenerationFailed(APIError):
    def __init__(self) -> None:
        # Why stays in the engine's log under the request id: exception text is not the tenant's business.
        message = "The model failed while generating this response; please retry."
        super().__init__(500, message, type="server_error", code="generation_failed")


def _retry_after(seconds: float) -> dict[str, str]:
    return {
        "retry-after": str(max(1, math.ceil(seconds))),
        "retry-after-ms": str(max(1, round(seconds * 1000))),
    }


class TooManyFailedAuthentications(APIError):
    def __init__(self, retry_after_s: float, credential: str = "API keys") -> None:
        # Says nothing about any key: only that this client has failed too often.
        message = (
            f"Too many requests with invalid {credential} from this client. Please try again in "
            f"{math.ceil(retry_after_s)}s."
        )
        super().__init__(
            429, message, code="too_many_failed_authentications", headers=_retry_after(retry_after_s)
        )


class ReadRateLimited(APIError):
    def __init__(self, retry_after_s: float, per_minute: int) -> None:
        message = (
            f"Rate limit reached for reads (/v1/models, /v1/usage, /v1/limits): {per_minute} per minute. "
            f"Please try again in {retry_after_s:.3g}s."
        )
        super().__init__(429, message, code="rate_limit_exceeded", headers=_retry_after(retry_after_s))


class NotReady(APIError):
    def __init__(self, details: str | None) -> None:
        """`details`: the failed checks, where this listener names them."""
        message = f"Not ready: {details}" if details else "Not ready."
        super().__init__(503, message, type="server_error", code="not_ready", headers={"retry-after": "1"})


def to_api_error(error: Exception) -> APIError:
    """Map a domain error to its HTTP form. Unknown errors become a 500 that reveals nothing."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, LimiterUnavailable):
        message = "Rate limiting is unavailable right now; please retry shortly."
        return APIError(
            503, message, type="server_error", code="rate_limiter_unavailable", headers={"retry-after": "1"}
        )
    if isinstance(error, PromptTooLong):
        return APIError(400, str(error), param=error.param, code="context_length_exceeded")
    if isinstance(error, InvalidTokenCount):  # the schema's bounds normally stop such numbers first
        return APIError(400, str(error), param="max_tokens")
    if isinstance(error, BudgetTooSmall):
        return APIError(400, str(error), param="max_tokens", code="max_tokens_too_small")
    if isinstance(error, InvalidRequest):
        return APIError(400, str(error), param=error.param)
    if isinstance(error, QueueShareExceeded):  # this tenant's own backlog, not the engine's: throttled
        log.info("engine queue share exceeded: %s", error)
        message = "Too many of your requests wait for this model while others wait too; please retry shortly."
        return APIError(429, message, code="queue_share_exceeded", headers={"retry-after": "1"})
    if isinstance(error, EngineOverloaded | EngineStopped):
        log.info("engine unavailable: %s", error)  # queue depths and causes stay in the log
        message = "The model is overloaded or restarting; please retry shortly."
        if isinstance(error, ReplicaLost):  # what the client already received is its own business
            message = f"The model's replica stopped during this request: {error}."
        return APIError(
            503, message, type="server_error", code="engine_unavailable", headers={"retry-after": "1"}
        )
    if isinstance(error, RequestFailed):
        log.warning("generation failed: %s", error)
        return GenerationFailed()
    if isinstance(error, AdapterNotFound):  # tenants get ModelNotFound (completions/generation.py)
        return APIError(404, str(error), param="model", code="model_not_found")
    if isinstance(error, AdapterStoreUnsafe):  # not transient: no retry-after; the reason is in the log
        log.error("adapter upload refused: %s", error)
        message = (
            "Adapter uploads are disabled: the adapter store does not refuse a second create of one object, "
            "so concurrent uploads could overwrite each other. The server log says more."
        )
        return APIError(503, message, type="server_error", code="adapter_uploads_disabled")
    if isinstance(error, AdapterLoadFailed):
        # A registered adapter the engine cannot read (its files vanished or broke, the store failed it):
        # the platform's fault, and the engine tries the load again after a backoff.
        log.warning("adapter unavailable: %s", error)  # which version and why: the operator's
        message = "The model is temporarily unavailable; please retry shortly."
        return APIError(503, message, type="server_error", code="model_unavailable", headers=_retry_after(5))
    if isinstance(
        error, AdapterStoreUnavailable
    ):  # where and why stay in the log (the URL is the operator's)
        log.warning("adapter store unavailable: %s", error)
        message = "The adapter store is unavailable right now; please retry shortly."
        return APIError(
            503, message, type="server_error", code="adapter_store_unavailable", headers={"retry-after": "5"}
        )
    if isinstance(error, AdapterInvalid):
        # Also an engine's answer for a registered adapter it cannot serve: a rank above its max_lora_rank
        # (an operator lowered it), an option or target it does not support. Those are properties of the
        # adapter that no retry changes and a new upload does, so 400 naming them (never a 5xx, which
        # clients retry); the problems name the adapter's config, not ids or paths.
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
    if isinstance(error, DatabaseNotMigrated):  # the operator's to fix: say exactly how
        return APIError(
            503, str(error), type="server_error", code="database_not_migrated", headers={"retry-after": "5"}
        )
    if isinstance(error, PoolTimeout):  # every pooled connection busy past pool_timeout: overloaded, not down
        log.warning("database connection pool exhausted: %s", error)
        message = "The platform's database is busy right now; please retry shortly."
        return APIError(503, message, type="server_error", code="database_busy", headers={"retry-after": "1"})
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
    for kind in (APIError, AdapterError, BillingError, EngineError, LimiterUnavailable):
        app.add_exception_handler(kind, handler)
    # Anything else is turned into a 500 by RequestContextMiddleware, which also stamps x-request-id on it.
