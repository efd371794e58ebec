"""Route classes that authenticate before FastAPI reads the request body.

FastAPI parses the body before it solves dependencies, so with auth as a plain dependency a caller
without credentials would be told about malformed JSON or schema problems (400) instead of getting 401.
These routes check credentials first and leave the result on `request.state` for the dependencies.
A tenant request refused for its own input still counts against the tenant's requests per minute.
A route marked `@admits` (one that runs an engine request through admission) answers a tenant refused
for its requests per minute a moment ago with that 429 before its body is read or parsed, and without
asking the limiter (app/limits/refusal_cache.py).
"""

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from app import log_context
from app.auth.authenticator import Principal
from app.auth.client_address import client_of
from app.completions.admission import Admission, refused_before_parsing
from app.errors import APIError
from app.middleware import request_id_of
from app.services import Services

REFUSED_FOR_INPUT = {400, 404, 422}  # the request itself was wrong: it still counts against RPM

Handler = Callable[[Request], Coroutine[Any, Any, Response]]
Endpoint = TypeVar("Endpoint", bound=Callable[..., Any])
_ADMITS = "_loraplex_admits"


# What FastAPI documents for the `authorization: Header()` of app/deps.py's get_principal, for routes that
# read their caller with `tenant_call` instead: the route class reads the header either way.
BEARER_HEADER: dict[str, Any] = {
    "parameters": [
        {
            "name": "authorization",
            "in": "header",
            "required": False,
            "schema": {"anyOf": [{"type": "string"}, {"type": "null"}], "title": "Authorization"},
        }
    ]
}


@dataclass(frozen=True)
class TenantCall:
    """Who called an admitting route, with what, under which request id."""

    principal: Principal
    services: Services
    request_id: str


def tenant_call(request: Request) -> TenantCall:
    """The caller of a TenantRoute endpoint, read straight from the request. The engine routes (chat,
    completions, responses) use it instead of three FastAPI dependencies, whose solving cost ~0.4 ms a
    request on a 2-core EPYC: a fifth of the whole ingress's work (bench.gateway)."""
    return TenantCall(
        request.state.principal, request.app.state.services, request_id_of(request.scope["state"])
    )


def admits(endpoint: Endpoint) -> Endpoint:
    """Marks a TenantRoute endpoint that admits an engine request (chat, completions, responses): a tenant
    over its requests per minute is refused before its body is parsed. Reads stay free of it."""
    setattr(endpoint, _ADMITS, True)
    return endpoint


class TenantRoute(APIRoute):
    def get_route_handler(self) -> Handler:
        handler = super().get_route_handler()
        admitting = bool(getattr(self.endpoint, _ADMITS, False))

        async def authenticated(request: Request) -> Response:
            services = request.app.state.services
            client = client_of(request)
            principal = await services.authenticator.authenticate(
                request.headers.get("authorization"), client
            )
            request.state.principal = principal
            # Not reset here: a streamed body is sent after this returns. The middleware's reset ends it.
            log_context.bind(tenant=principal.tenant_id)
            if admitting:  # before the body is read: FastAPI parses it inside `handler`
                refused = refused_before_parsing(
                    services.refusals,
                    tenant=principal.tenant_id,
                    tier=principal.tier,
                    limits=principal.limits,
                )
                if refused is not None:
                    raise refused
            try:
                return await handler(request)
            except (RequestValidationError, APIError) as error:
                if isinstance(error, RequestValidationError) or error.status in REFUSED_FOR_INPUT:
                    await Admission.count_refused(
                        services.limiter,
                        tenant=principal.tenant_id,
                        request_id=f"{request_id_of(request.scope['state'])}.refused",
                        limits=principal.limits,
                        refusals=services.refusals,
                    )
                raise

        return authenticated


class AdminRoute(APIRoute):
    def get_route_handler(self) -> Handler:
        handler = super().get_route_handler()

        async def authorised(request: Request) -> Response:
            services = request.app.state.services
            services.admin_auth.check(request.headers.get("authorization"), client_of(request))
            return await handler(request)

        return authorised
