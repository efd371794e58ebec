"""Queries over a Session, keyword-only, raising billing.errors.

Functions flush but never commit: the caller owns the transaction (billing.db.session_scope). Rows are
never deleted, since usage history refers to tenants and keys. Uniqueness is checked before writing, so
the usual conflict is a domain error; two writers racing past the check get the database's IntegrityError.
"""

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from billing.errors import ApiKeyNotFound, TenantNameTaken, TenantNotFound, TierExists, TierNotFound
from billing.models import ApiKey, Tenant, TenantStatus, Tier, utcnow

# Tiers


def create_tier(s: Session, *, name: str, description: str = "") -> Tier:
    if s.get(Tier, name) is not None:
        raise TierExists(name)
    tier = Tier(name=name, description=description)
    s.add(tier)
    s.flush()
    return tier


def get_tier(s: Session, *, name: str) -> Tier:
    tier = s.get(Tier, name)
    if tier is None:
        raise TierNotFound(name)
    return tier


def list_tiers(s: Session) -> Sequence[Tier]:
    return s.scalars(select(Tier).order_by(Tier.name)).all()


# Tenants


def create_tenant(s: Session, *, name: str, tier: str = "free") -> Tenant:
    get_tier(s, name=tier)
    _check_name_free(s, name)
    now = utcnow()  # one instant for both: a tenant never updated has updated_at == created_at
    tenant = Tenant(name=name, tier=tier, created_at=now, updated_at=now)
    s.add(tenant)
    s.flush()
    return tenant


def get_tenant(s: Session, *, tenant_id: str) -> Tenant:
    tenant = s.get(Tenant, tenant_id)
    if tenant is None:
        raise TenantNotFound(tenant_id)
    return tenant


def list_tenants(s: Session, *, include_disabled: bool = True) -> Sequence[Tenant]:
    query = select(Tenant).order_by(Tenant.created_at, Tenant.id)
    if not include_disabled:
        query = query.where(Tenant.status == TenantStatus.ACTIVE.value)
    return s.scalars(query).all()


def update_tenant(s: Session, *, tenant_id: str, name: str | None = None, tier: str | None = None) -> Tenant:
    """Rename and/or move to another tier; None leaves a field as it is."""
    tenant = get_tenant(s, tenant_id=tenant_id)
    if name is not None and name != tenant.name:
        _check_name_free(s, name)
        tenant.name = name
    if tier is not None:
        tenant.tier = get_tier(s, name=tier).name
    s.flush()
    return tenant


def disable_tenant(s: Session, *, tenant_id: str) -> Tenant:
    """Disable the tenant and revoke its keys. Idempotent: a second call changes nothing."""
    tenant = get_tenant(s, tenant_id=tenant_id)
    if tenant.status != TenantStatus.DISABLED:
        now = utcnow()
        tenant.status = TenantStatus.DISABLED.value
        tenant.disabled_at = now
        s.execute(
            update(ApiKey)
            .where(ApiKey.tenant_id == tenant_id, ApiKey.revoked_at.is_(None))
            .values(revoked_at=now)
        )
    s.flush()
    return tenant


def _check_name_free(s: Session, name: str) -> None:
    # Exact match, as the unique constraint compares: "Acme" and "acme" are two names.
    if s.scalar(select(Tenant.id).where(Tenant.name == name)) is not None:
        raise TenantNameTaken(name)


# API keys


def create_api_key(
    s: Session,
    *,
    tenant_id: str,
    prefix: str,
    key_hash: str,
    name: str | None = None,
    expires_at: datetime | None = None,
) -> ApiKey:
    """Store a key made by app.auth.generate_key; a disabled tenant counts as not found."""
    tenant = s.get(Tenant, tenant_id)
    if tenant is None or tenant.status != TenantStatus.ACTIVE:
        raise TenantNotFound(tenant_id)
    key = ApiKey(tenant_id=tenant_id, prefix=prefix, key_hash=key_hash, name=name, expires_at=expires_at)
    s.add(key)
    s.flush()
    return key


def list_api_keys(s: Session, *, tenant_id: str) -> Sequence[ApiKey]:
    """Every key of the tenant, revoked and expired ones included."""
    get_tenant(s, tenant_id=tenant_id)
    query = select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at, ApiKey.id)
    return s.scalars(query).all()


def get_api_key(s: Session, *, key_id: str) -> ApiKey:
    key = s.get(ApiKey, key_id)
    if key is None:
        raise ApiKeyNotFound(key_id)
    return key


def revoke_api_key(s: Session, *, key_id: str) -> ApiKey:
    """Idempotent: a revoked key keeps its first revocation time."""
    key = get_api_key(s, key_id=key_id)
    if key.revoked_at is None:
        key.revoked_at = utcnow()
        s.flush()
    return key


def find_active_key(s: Session, *, prefix: str, now: datetime) -> tuple[ApiKey, Tenant] | None:
    """The key with this prefix and its tenant, if the key may authenticate at `now`.

    None when the key is unknown, revoked, expired (expires_at <= now) or its tenant is disabled. The
    caller still verifies the hash (app.auth.verify_key).
    """
    query = (
        select(ApiKey, Tenant)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(
            ApiKey.prefix == prefix,
            ApiKey.revoked_at.is_(None),
            or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > now),
            Tenant.status == TenantStatus.ACTIVE.value,
        )
    )
    row = s.execute(query).one_or_none()
    return None if row is None else (row[0], row[1])


def touch_key(s: Session, *, key_id: str, now: datetime) -> None:
    """Record a use; never moves last_used_at backwards (ingress replicas report out of order)."""
    key = get_api_key(s, key_id=key_id)
    if key.last_used_at is None or key.last_used_at < now:
        key.last_used_at = now
        s.flush()
