"""FastAPI dependency aliases: what a route asks for, resolved per request.

Credentials are checked by the route classes in app/routes/guarded.py before the body is read; these
dependencies hand the result to the route (and document the security scheme in OpenAPI).
"""

from typing import Annotated

from fastapi import Depends, Header, Request

from app.authenticator import Principal
from app.middleware import request_id_of
from app.services import Services


def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


async def get_principal(
    request: Request, services: ServicesDep, authorization: Annotated[str | None, Header()] = None
) -> Principal:
    principal: Principal | None = getattr(request.state, "principal", None)
    return principal or await services.authenticator.authenticate(authorization)


TenantDep = Annotated[Principal, Depends(get_principal)]


def require_admin(authorization: Annotated[str | None, Header()] = None) -> None:
    """Checked by AdminRoute before the body is read; declared here so routes state they need it."""


AdminDep = Annotated[None, Depends(require_admin)]


def get_request_id(request: Request) -> str:
    return request_id_of(request.scope.get("state", {}))


RequestIdDep = Annotated[str, Depends(get_request_id)]
