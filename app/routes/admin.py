"""Admin API: pricing tiers, tenants and their keys (Authorization: Bearer LORAPLEX_ADMIN_KEY).

Database work is synchronous SQLAlchemy, so these are plain `def` routes: FastAPI runs them in its
thread pool and the event loop keeps serving inference.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

from fastapi import APIRouter, status
from sqlalchemy.orm import Session

from app.auth.api_keys import generate_key
from app.auth.authenticator import limits_for
from app.deps import AdminDep, ServicesDep
from app.errors import Conflict, InvalidParameter, NotFound
from app.route_guards import AdminRoute
from app.schemas.admin import (
    KeyCreate,
    KeyCreated,
    KeyList,
    KeyOut,
    TenantCreate,
    TenantList,
    TenantOut,
    TenantUpdate,
    TierCreate,
    TierList,
    TierOut,
    TierUpdate,
)
from billing import repository
from billing.errors import InvalidPrice, InvalidStripeCustomer, TierExists, TierNotFound
from billing.models import LIMIT_FIELDS, Tenant

router = APIRouter(prefix="/admin", tags=["admin"], route_class=AdminRoute)


# --- tiers -----------------------------------------------------------------------------------------------


@contextmanager
def _tier_errors() -> Iterator[None]:
    """On the tier routes the tier is the resource: unknown is 404 (elsewhere, a bad `tier` field: 400)."""
    try:
        yield
    except TierNotFound as error:
        raise NotFound(str(error)) from None
    except TierExists as error:
        raise Conflict(str(error), param="name") from None
    except InvalidPrice as error:  # the schema checks first; this is the repository's own guard
        raise InvalidParameter(str(error), param=error.field, code="invalid_price") from None


@router.post("/tiers", status_code=status.HTTP_201_CREATED)
def create_tier(body: TierCreate, _: AdminDep, services: ServicesDep) -> TierOut:
    with _tier_errors(), services.session_factory() as session, session.begin():
        return TierOut.model_validate(repository.create_tier(session, **body.model_dump()))


@router.get("/tiers")
def list_tiers(_: AdminDep, services: ServicesDep) -> TierList:
    with services.session_factory() as session:
        return TierList(data=[TierOut.model_validate(t) for t in repository.list_tiers(session)])


@router.get("/tiers/{name}")
def get_tier(name: str, _: AdminDep, services: ServicesDep) -> TierOut:
    with _tier_errors(), services.session_factory() as session:
        return TierOut.model_validate(repository.get_tier(session, name=name))


@router.patch("/tiers/{name}")
def update_tier(name: str, body: TierUpdate, _: AdminDep, services: ServicesDep) -> TierOut:
    """Changes the fields given (a limit given as null becomes unlimited); tenants on the tier see the new
    limits within the auth cache's TTL. New prices apply from now on: what was settled keeps its cost, and
    bills show the settled costs."""
    with _tier_errors(), services.session_factory() as session, session.begin():
        return TierOut.model_validate(repository.update_tier(session, name=name, **body.changes()))


# --- tenants ---------------------------------------------------------------------------------------------


def _tenant_out(session: Session, tenant: Tenant) -> TenantOut:
    return TenantOut.of(tenant, limits_for(repository.get_tier(session, name=tenant.tier), tenant))


@router.post("/tenants", status_code=status.HTTP_201_CREATED)
def create_tenant(body: TenantCreate, _: AdminDep, services: ServicesDep) -> TenantOut:
    with services.session_factory() as session, session.begin():
        tenant = repository.create_tenant(session, name=body.name, tier=body.tier)
        return _tenant_out(session, tenant)


@router.get("/tenants")
def list_tenants(_: AdminDep, services: ServicesDep) -> TenantList:
    with services.session_factory() as session:
        tiers = {tier.name: tier for tier in repository.list_tiers(session)}
        return TenantList(
            data=[TenantOut.of(t, limits_for(tiers[t.tier], t)) for t in repository.list_tenants(session)]
        )


@router.get("/tenants/{tenant_id}")
def get_tenant(tenant_id: str, _: AdminDep, services: ServicesDep) -> TenantOut:
    with services.session_factory() as session:
        return _tenant_out(session, repository.get_tenant(session, tenant_id=tenant_id))


@router.patch("/tenants/{tenant_id}")
def update_tenant(tenant_id: str, body: TenantUpdate, _: AdminDep, services: ServicesDep) -> TenantOut:
    """Rename, move to another tier, set limit overrides (null clears one) and/or the Stripe customer
    (null clears it). All or nothing; the tenant's requests see new limits within the auth cache's TTL."""
    changes = body.changes()
    overrides = {field: value for field, value in changes.items() if field in LIMIT_FIELDS}
    customer = {k: v for k, v in changes.items() if k == "stripe_customer_id"}
    try:
        with services.session_factory() as session, session.begin():
            repository.update_tenant(session, tenant_id=tenant_id, name=body.name, tier=body.tier, **customer)
            tenant = repository.update_tenant_limits(session, tenant_id=tenant_id, **overrides)
            return _tenant_out(session, tenant)
    except InvalidStripeCustomer as error:  # the schema checks first; this is the repository's own guard
        raise InvalidParameter(str(error), param=error.field, code="invalid_stripe_customer") from None


@router.delete("/tenants/{tenant_id}")
def disable_tenant(tenant_id: str, _: AdminDep, services: ServicesDep) -> TenantOut:
    """Disables the tenant and revokes its keys; its stored responses and files go, its other rows and
    usage history stay."""
    with services.session_factory() as session, session.begin():
        return _tenant_out(session, repository.disable_tenant(session, tenant_id=tenant_id))


@router.post("/tenants/{tenant_id}/keys", status_code=status.HTTP_201_CREATED)
def create_key(
    tenant_id: str, _: AdminDep, services: ServicesDep, body: KeyCreate | None = None
) -> KeyCreated:
    body = body or KeyCreate()
    if body.expires_at is not None and body.expires_in_days is not None:
        raise InvalidParameter("give expires_at or expires_in_days, not both", param="expires_at")
    expires_at = body.expires_at
    if body.expires_in_days is not None:
        expires_at = datetime.now(UTC) + timedelta(days=body.expires_in_days)
    if expires_at is not None:
        expires_at = expires_at if expires_at.tzinfo else expires_at.replace(tzinfo=UTC)
        if expires_at <= datetime.now(UTC):
            raise InvalidParameter("expires_at must be in the future", param="expires_at")
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
