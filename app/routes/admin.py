"""Admin API: tenants and their keys (Authorization: Bearer LORAPLEX_ADMIN_KEY).

Database work is synchronous SQLAlchemy, so these are plain `def` routes: FastAPI runs them in its
thread pool and the event loop keeps serving inference.
"""

from datetime import UTC, datetime, timedelta

from fastapi import APIRouter, status

from app.auth import generate_key
from app.deps import AdminDep, ServicesDep
from app.errors import APIError
from app.routes.guarded import AdminRoute
from app.schemas.admin import (
    KeyCreate,
    KeyCreated,
    KeyList,
    KeyOut,
    TenantCreate,
    TenantList,
    TenantOut,
    TenantUpdate,
)
from billing import repository

router = APIRouter(prefix="/admin", tags=["admin"], route_class=AdminRoute)


@router.post("/tenants", status_code=status.HTTP_201_CREATED)
def create_tenant(body: TenantCreate, _: AdminDep, services: ServicesDep) -> TenantOut:
    with services.session_factory() as session, session.begin():
        tenant = repository.create_tenant(session, name=body.name, tier=body.tier)
        return TenantOut.model_validate(tenant)


@router.get("/tenants")
def list_tenants(_: AdminDep, services: ServicesDep) -> TenantList:
    with services.session_factory() as session:
        return TenantList(data=[TenantOut.model_validate(t) for t in repository.list_tenants(session)])


@router.get("/tenants/{tenant_id}")
def get_tenant(tenant_id: str, _: AdminDep, services: ServicesDep) -> TenantOut:
    with services.session_factory() as session:
        return TenantOut.model_validate(repository.get_tenant(session, tenant_id=tenant_id))


@router.patch("/tenants/{tenant_id}")
def update_tenant(tenant_id: str, body: TenantUpdate, _: AdminDep, services: ServicesDep) -> TenantOut:
    with services.session_factory() as session, session.begin():
        tenant = repository.update_tenant(session, tenant_id=tenant_id, name=body.name, tier=body.tier)
        return TenantOut.model_validate(tenant)


@router.delete("/tenants/{tenant_id}")
def disable_tenant(tenant_id: str, _: AdminDep, services: ServicesDep) -> TenantOut:
    """Disables the tenant and revokes its keys; its rows and usage history stay."""
    with services.session_factory() as session, session.begin():
        return TenantOut.model_validate(repository.disable_tenant(session, tenant_id=tenant_id))


@router.post("/tenants/{tenant_id}/keys", status_code=status.HTTP_201_CREATED)
def create_key(
    tenant_id: str, _: AdminDep, services: ServicesDep, body: KeyCreate | None = None
) -> KeyCreated:
    body = body or KeyCreate()
    if body.expires_at is not None and body.expires_in_days is not None:
        raise APIError(400, "give expires_at or expires_in_days, not both", param="expires_at")
    expires_at = body.expires_at
    if body.expires_in_days is not None:
        expires_at = datetime.now(UTC) + timedelta(days=body.expires_in_days)
    if expires_at is not None:
        expires_at = expires_at if expires_at.tzinfo else expires_at.replace(tzinfo=UTC)
        if expires_at <= datetime.now(UTC):
            raise APIError(400, "expires_at must be in the future", param="expires_at")
    new = generate_key(services.key_secret)
    with services.session_factory() as session, session.begin():
        api_key = repository.create_api_key(
            session,
            tenant_id=tenant_id,
            prefix=new.prefix,
            key_hash=new.hash,
            name=body.name,
            expires_at=expires_at,
        )
        return KeyCreated(**KeyOut.model_validate(api_key).model_dump(), key=new.plaintext)


@router.get("/tenants/{tenant_id}/keys")
def list_keys(tenant_id: str, _: AdminDep, services: ServicesDep) -> KeyList:
    with services.session_factory() as session:
        repository.get_tenant(session, tenant_id=tenant_id)
        return KeyList(
            data=[KeyOut.model_validate(k) for k in repository.list_api_keys(session, tenant_id=tenant_id)]
        )


@router.delete("/keys/{key_id}")
def revoke_key(key_id: str, _: AdminDep, services: ServicesDep) -> KeyOut:
    with services.session_factory() as session, session.begin():
        return KeyOut.model_validate(repository.revoke_api_key(session, key_id=key_id))
