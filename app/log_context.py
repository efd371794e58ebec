"""Log context: the request id, trace id, tenant and adapter on every log record of a request.

The middleware binds the request id (ours, `req_...`, the id usage rows carry) and the trace id (the
client's `x-request-id`, which behind Serve is also Serve's own request id); the tenant routes bind the
tenant, a generation its model and adapter. They live in contextvars, so concurrent requests never mix, and
LogContextFilter copies them onto each record as attributes. Ray's formatters print such attributes: with
Serve's `logging_config: {encoding: JSON}` each is a field of the line, e.g.
`{"message": "...", "request_id": "req_...", "tenant": "t_...", "adapter": "ad_...@v2", ...}`.

A filter on handlers rather than a LogRecord factory: a factory's attributes would make any
`log.info(..., extra={"tenant": ...})` raise KeyError.
"""

import logging
from contextvars import ContextVar, Token

FIELDS = ("request_id", "trace_id", "tenant", "model", "adapter")
PACKAGES = ("app", "deployments", "adapters", "billing")  # our loggers' roots
SERVE_LOGGER = "ray.serve"

_context: ContextVar[dict[str, str] | None] = ContextVar("loraplex_log_context", default=None)


def bind(**fields: str | None) -> Token[dict[str, str] | None]:
    """Add fields to this context (and the tasks it starts); `reset` with the token undoes it."""
    unknown = set(fields) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown log context fields: {sorted(unknown)}")
    merged = {**current(), **{k: v for k, v in fields.items() if v is not None}}
    return _context.set(merged)


def reset(token: Token[dict[str, str] | None]) -> None:
    _context.reset(token)


def current() -> dict[str, str]:
    return _context.get() or {}


class LogContextFilter(logging.Filter):
    """Stamps the bound fields on each record it sees; filters nothing out."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in current().items():
            setattr(record, key, value)
        return True


def attach(handler: logging.Handler) -> None:
    """Add the filter last (after Serve's own, whose `request_id` ours replaces); idempotent."""
    if not any(isinstance(f, LogContextFilter) for f in handler.filters):
        handler.addFilter(LogContextFilter())


class _ToServe(logging.Handler):
    """Hands our packages' records to Serve's logger, whatever handlers it has now (Serve replaces them
    when its logging_config changes)."""

    def emit(self, record: logging.LogRecord) -> None:
        serve = logging.getLogger(SERVE_LOGGER)
        for handler in serve.handlers:
            attach(handler)
        serve.handle(record)


def route_to_serve() -> None:
    """In a Serve replica: our loggers write through Serve's (its replica log file, its encoding, its
    request context), with our fields. Elsewhere nothing changes. Idempotent."""
    if not _in_serve_replica():
        return
    serve = logging.getLogger(SERVE_LOGGER)
    for handler in serve.handlers:
        attach(handler)
    for name in PACKAGES:
        logger = logging.getLogger(name)
        if not any(isinstance(h, _ToServe) for h in logger.handlers):
            logger.addHandler(_ToServe())
        logger.propagate = False  # else each line also reaches the worker's root handler, unformatted
        if logger.level == logging.NOTSET:
            logger.setLevel(serve.level or logging.INFO)


def _in_serve_replica() -> bool:
    try:
        from ray import serve

        serve.get_replica_context()
    except Exception:  # RayServeException outside a replica
        return False
    return True
