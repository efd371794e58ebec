"""FastAPI dependency aliases: what a route asks for, resolved per request.

Credentials are checked by the route classes in app/route_guards.py before the body is read; these
dependencies hand the result to the route (and document the security scheme in OpenAPI).
"""

import time
from typing import Annotated

from fastapi import Depends, Header, Request

from app.auth.authenticator import Principal
from app.auth.client_address import client_of
from app.errors import ReadRateLimited
from app.middleware import request_id_of
from app.read_rate import ReadRate
from app.services import Services


# Dependencies are coroutines: FastAPI runs a plain function's in the thread pool, a hop per request
# that costs more than the function.
async def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


async def get_principal(
    request: Request, services: ServicesDep, authorization: Annotated[str | None, Header()] = None
) -> Principal:
    principal: Principal | None = getattr(request.state, "principal", None)
    if principal is not None:
        return principal
    return await services.authenticator.authenticate(authorization, client_of(request))


TenantDep = Annotated[Principal, Depends(get_principal)]


def read_rate(request: Request, services: Services) -> ReadRate:
    """The app's one ReadRate, made on first use from the settings (never at import time)."""
    rate: ReadRate | None = getattr(request.app.state, "read_rate", None)
    if rate is None:
        settings = services.settings
        rate = request.app.state.read_rate = ReadRate(per_minute=settings.read_rpm, burst=settings.read_burst)
    return rate


async def get_reader(request: Request, principal: TenantDep, services: ServicesDep) -> Principal:
    """The tenant, once one read is taken at its read rate (429 with retry-after when it has none left)."""
    rate = read_rate(request, services)
    wait = rate.take(principal.tenant_id, time.monotonic())
    if wait is not None:
        raise ReadRateLimited(wait, rate.per_minute)
    return principal


ReaderDep = Annotated[Principal, Depends(get_reader)]


async def require_admin(authorization: Annotated[str | None, Header()] = None) -> None:
    """Checked by AdminRoute before the body is read; declared here so routes state they need it."""


AdminDep = Annotated[None, Depends(require_admin)]


async def get_request_id(request: Request) -> str:
    return request_id_of(request.scope.get("state", {}))


RequestIdDep = Annotated[str, Depends(get_request_id)]
