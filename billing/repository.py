"""Queries over a Session, keyword-only, raising billing.errors.

Functions flush but never commit: the caller owns the transaction (billing.db.session_scope). Rows are
never deleted, since usage history refers to tenants and keys; a disabled tenant's stored responses (its
content, not its history) are. Uniqueness is checked before writing, so
the usual conflict is a domain error; two writers racing past the check get the database's IntegrityError.
"""

import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from decimal import Decimal, InvalidOperation
from enum import Enum
from typing import Final, Literal

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.orm import Session

from billing.errors import (
    ApiKeyNotFound,
    InvalidLimits,
    InvalidPrice,
    InvalidStripeCustomer,
    TenantNameTaken,
    TenantNotFound,
    TierExists,
    TierNotFound,
)
from billing.models import (
    LIMIT_FIELDS,
    ApiKey,
    PriceChange,
    StorageHold,
    StoredFile,
    StoredResponse,
    Tenant,
    TenantStatus,
    Tier,
    utcnow,
)


class _Unset(Enum):
    """The type of UNSET: an update argument that was not given (None is a value: unlimited)."""

    UNSET = "UNSET"


UNSET: Final = _Unset.UNSET

OnLimit = Literal["reject", "queue"]
ON_LIMIT_VALUES: Final = ("reject", "queue")
MAX_QUEUE_MS: Final = 60_000
MAX_WEIGHT: Final = 1000.0  # a tier's weight: its tenants' share of a replica against weight-1 tenants
# The columns' ranges: INTEGER is 32-bit on PostgreSQL, tpm is BIGINT.
_INT32_MAX: Final = 2**31 - 1
LIMIT_MAX: Final = {
    "rpm": _INT32_MAX,
    "tpm": 2**63 - 1,
    "max_concurrent": _INT32_MAX,
    "max_tokens_cap": _INT32_MAX,
    "max_stored_response_bytes": 2**63 - 1,  # a tier's only: its tenants' stored responses (issue 35)
}


def check_limit(field: str, value: object) -> int | None:
    """A limit as stored: a positive integer (within its column's range), or None for unlimited."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= LIMIT_MAX[field]:
        raise InvalidLimits(field, value, f"a positive integer up to {LIMIT_MAX[field]} or null (unlimited)")
    return value


def check_weight(weight: object) -> float:
    """A tier's weight as stored: a number above 0, up to MAX_WEIGHT."""
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight <= MAX_WEIGHT:
        raise InvalidLimits("weight", weight, f"a number above 0 and up to {MAX_WEIGHT:g}")
    return float(weight)


def check_price_factor(factor: object) -> Decimal:
    """A tier's batch price factor as stored: 0 to 1 (a batch line costs at most an interactive one)."""
    try:
        value = Decimal(str(factor))
    except ArithmeticError:
        raise InvalidPrice("batch_price_factor", factor, "a number from 0 to 1") from None
    exponent = value.as_tuple().exponent
    places = -exponent if isinstance(exponent, int) else 99
    if isinstance(factor, bool) or not value.is_finite() or not 0 <= value <= 1 or places > 4:
        raise InvalidPrice("batch_price_factor", factor, "a number from 0 to 1, at most 4 decimals")
    return value


def check_on_limit(on_limit: object, max_queue_ms: object) -> None:
    """What happens over a limit: reject (429 at once), or queue for 1..60000 ms first."""
    if on_limit not in ON_LIMIT_VALUES:
        raise InvalidLimits("on_limit", on_limit, "'reject' or 'queue'")
    if (
        isinstance(max_queue_ms, bool)
        or not isinstance(max_queue_ms, int)
        or not 0 <= max_queue_ms <= MAX_QUEUE_MS
    ):
        raise InvalidLimits("max_queue_ms", max_queue_ms, f"an integer from 0 to {MAX_QUEUE_MS}")
    if on_limit == "queue" and max_queue_ms == 0:
        raise InvalidLimits("max_queue_ms", max_queue_ms, "more than 0 when on_limit is 'queue'")


PRICE_FIELDS: Final = (
    "price_input_per_mtok",
    "price_cached_input_per_mtok",
    "price_output_per_mtok",
    "price_gpu_per_second",
)
PRICE_DECIMALS: Final = 6  # the columns' scale: Numeric(18, 6)
# At most 15 significant digits (9 before the point): SQLite stores NUMERIC as a double, which keeps any
# decimal of 15 significant digits exactly, so a price reads back as written on both backends.
PRICE_MAX_DIGITS: Final = 15
PRICE_STEP: Final = Decimal(1).scaleb(-PRICE_DECIMALS)  # 0.000001
PRICE_MAX: Final = Decimal(10) ** (PRICE_MAX_DIGITS - PRICE_DECIMALS) - PRICE_STEP  # 999999999.999999
_CURRENCY = re.compile(r"^[a-z]{3}$")
_STRIPE_CUSTOMER = re.compile(r"^cus_[A-Za-z0-9]{1,60}$")


def check_price(field: str, value: object) -> Decimal:
    """A price as stored: a finite, non-negative Decimal (or int, or decimal string) with at most 6
    decimals, up to PRICE_MAX. Floats are refused: they carry binary fractions (0.1 is not 1/10)."""
    requirement = f"a decimal from 0 to {PRICE_MAX} with at most {PRICE_DECIMALS} decimals"
    if isinstance(value, bool) or not isinstance(value, Decimal | int | str):
        raise InvalidPrice(field, value, requirement)
    try:
        price = Decimal(value)
    except (InvalidOperation, ValueError):
        raise InvalidPrice(field, value, requirement) from None
    if not price.is_finite() or not 0 <= price <= PRICE_MAX:
        raise InvalidPrice(field, value, requirement)
    stored = price.quantize(PRICE_STEP)  # exact comparison: a 7th decimal, however small, is refused
    if stored != price:
        raise InvalidPrice(field, value, requirement)
    return stored


def check_currency(value: object) -> str:
    """An ISO 4217 code, stored lowercase as Stripe writes it ("usd")."""
    if not isinstance(value, str) or not _CURRENCY.match(value.lower()):
        raise InvalidPrice("currency", value, "a three-letter ISO 4217 currency code such as 'usd'")
    return value.lower()


def check_stripe_customer(value: object) -> str | None:
    """A Stripe customer id (`cus_` and letters or digits), or None for none."""
    if value is None:
        return None
    if not isinstance(value, str) or not _STRIPE_CUSTOMER.match(value):
        raise InvalidStripeCustomer("stripe_customer_id", value, "a Stripe customer id 'cus_...' or null")
    return value


# Tiers


def create_tier(
    s: Session,
    *,
    name: str,
    description: str = "",
    rpm: int | None = None,
    tpm: int | None = None,
    max_concurrent: int | None = None,
    max_tokens_cap: int | None = None,
    on_limit: OnLimit = "reject",
    max_queue_ms: int = 0,
    price_input_per_mtok: Decimal | int | str = 0,
    price_cached_input_per_mtok: Decimal | int | str = 0,
    price_output_per_mtok: Decimal | int | str = 0,
    price_gpu_per_second: Decimal | int | str = 0,
    currency: str = "usd",
    weight: float = 1.0,
    max_stored_response_bytes: int | None = None,
    batch_price_factor: Decimal | int | str = Decimal("0.5"),
    price_storage_per_gb_day: Decimal | int | str = 0,
) -> Tier:
    """A new tier; limits default to None (unlimited), prices to 0, the weight to 1. Raises TierExists,
    InvalidLimits (InvalidPrice for a price or the currency)."""
    limits = {
        field: check_limit(field, value)
        for field, value in zip(LIMIT_FIELDS, (rpm, tpm, max_concurrent, max_tokens_cap), strict=True)
    }
    check_on_limit(on_limit, max_queue_ms)
    weight = check_weight(weight)
    stored_bytes = check_limit("max_stored_response_bytes", max_stored_response_bytes)
    price_values = (
        price_input_per_mtok,
        price_cached_input_per_mtok,
        price_output_per_mtok,
        price_gpu_per_second,
    )
    prices = _checked_prices(dict(zip(PRICE_FIELDS, price_values, strict=True)))
    currency = check_currency(currency)
    if s.get(Tier, name) is not None:
        raise TierExists(name)
    tier = Tier(
        name=name,
        description=description,
        on_limit=on_limit,
        max_queue_ms=max_queue_ms,
        currency=currency,
        weight=weight,
        max_stored_response_bytes=stored_bytes,
        batch_price_factor=check_price_factor(batch_price_factor),
        price_storage_per_gb_day=check_price("price_storage_per_gb_day", price_storage_per_gb_day),
        **limits,
        **prices,
    )
    s.add(tier)
    s.flush()
    record_tier_prices(s, tier)
    return tier


def update_tier(
    s: Session,
    *,
    name: str,
    description: str | _Unset = UNSET,
    rpm: int | _Unset | None = UNSET,
    tpm: int | _Unset | None = UNSET,
    max_concurrent: int | _Unset | None = UNSET,
    max_tokens_cap: int | _Unset | None = UNSET,
    on_limit: OnLimit | _Unset = UNSET,
    max_queue_ms: int | _Unset = UNSET,
    price_input_per_mtok: Decimal | int | str | _Unset = UNSET,
    price_cached_input_per_mtok: Decimal | int | str | _Unset = UNSET,
    price_output_per_mtok: Decimal | int | str | _Unset = UNSET,
    price_gpu_per_second: Decimal | int | str | _Unset = UNSET,
    currency: str | _Unset = UNSET,
    weight: float | _Unset = UNSET,
    max_stored_response_bytes: int | _Unset | None = UNSET,
    batch_price_factor: Decimal | int | str | _Unset = UNSET,
    price_storage_per_gb_day: Decimal | int | str | _Unset = UNSET,
) -> Tier:
    """Change what is given (UNSET: left as it is; None for a limit: unlimited). All or nothing: the
    result is checked as a whole (on_limit 'queue' needs max_queue_ms > 0) before anything is written.
    Raises TierNotFound, InvalidLimits (InvalidPrice for a price or the currency). Tenants on the tier see
    new limits once their cached keys expire; new prices apply from now on (a new price history row): what
    was settled keeps its cost, and bills (billing.pricing) show the settled costs."""
    tier = get_tier(s, name=name)
    limits = _given(dict(zip(LIMIT_FIELDS, (rpm, tpm, max_concurrent, max_tokens_cap), strict=True)))
    if not isinstance(max_stored_response_bytes, _Unset):
        limits["max_stored_response_bytes"] = max_stored_response_bytes
    checked = {field: check_limit(field, value) for field, value in limits.items()}
    new_on_limit = tier.on_limit if isinstance(on_limit, _Unset) else on_limit
    new_queue_ms = tier.max_queue_ms if isinstance(max_queue_ms, _Unset) else max_queue_ms
    check_on_limit(new_on_limit, new_queue_ms)
    new_weight = None if isinstance(weight, _Unset) else check_weight(weight)
    price_values = (
        price_input_per_mtok,
        price_cached_input_per_mtok,
        price_output_per_mtok,
        price_gpu_per_second,
    )
    given_prices = dict(zip(PRICE_FIELDS, price_values, strict=True))
    prices = _checked_prices({field: v for field, v in given_prices.items() if not isinstance(v, _Unset)})
    new_currency = None if isinstance(currency, _Unset) else check_currency(currency)
    if new_currency is not None and new_currency != tier.currency:
        prepaid = select(Tenant.id).where(Tenant.tier == name, Tenant.prepaid.is_(True)).limit(1)
        if s.scalar(prepaid) is not None:  # their credit is money in the old currency
            raise InvalidPrice(
                "currency", currency, "unchanged while tenants on the tier hold prepaid credit"
            )
    before = _price_columns(tier)
    if not isinstance(description, _Unset):
        _assign(tier, "description", description)
    for field, value in checked.items():
        _assign(tier, field, value)
    for field, price in prices.items():
        _assign(tier, field, price)
    if new_currency is not None:
        _assign(tier, "currency", new_currency)
    _assign(tier, "on_limit", new_on_limit)
    _assign(tier, "max_queue_ms", new_queue_ms)
    if new_weight is not None:
        _assign(tier, "weight", new_weight)
    if not isinstance(batch_price_factor, _Unset):
        _assign(tier, "batch_price_factor", check_price_factor(batch_price_factor))
    if not isinstance(price_storage_per_gb_day, _Unset):
        storage_price = check_price("price_storage_per_gb_day", price_storage_per_gb_day)
        _assign(tier, "price_storage_per_gb_day", storage_price)
    s.flush()
    if _price_columns(tier) != before:  # a new row in the history; what was settled keeps its cost
        record_tier_prices(s, tier)
    return tier


def _price_columns(tier: Tier) -> tuple[object, ...]:
    return (*(Decimal(getattr(tier, f)) for f in PRICE_FIELDS), tier.currency)


def record_tier_prices(s: Session, tier: Tier) -> None:
    """The tier's current prices become its price history's newest row, in force from now."""
    s.add(
        PriceChange(
            tier=tier.name,
            effective_from=utcnow(),
            input_per_mtok=tier.price_input_per_mtok,
            cached_input_per_mtok=tier.price_cached_input_per_mtok,
            output_per_mtok=tier.price_output_per_mtok,
            gpu_per_second=tier.price_gpu_per_second,
            currency=tier.currency,
        )
    )
    s.flush()


def _checked_prices(values: Mapping[str, object]) -> dict[str, Decimal]:
    return {field: check_price(field, value) for field, value in values.items()}


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


def update_tenant(
    s: Session,
    *,
    tenant_id: str,
    name: str | None = None,
    tier: str | None = None,
    stripe_customer_id: str | _Unset | None = UNSET,
) -> Tenant:
    """Rename and/or move to another tier (None leaves either as it is); set the Stripe customer its usage
    is billed to (`cus_...`; None clears it; UNSET leaves it). Everything is checked before anything is
    written. Raises TenantNotFound, TenantNameTaken, TierNotFound, InvalidStripeCustomer."""
    tenant = get_tenant(s, tenant_id=tenant_id)
    customer = UNSET if isinstance(stripe_customer_id, _Unset) else check_stripe_customer(stripe_customer_id)
    if name is not None and name != tenant.name:
        _check_name_free(s, name)
    new_tier = None if tier is None else get_tier(s, name=tier).name
    moves = new_tier is not None and new_tier != tenant.tier
    # Credit is money in one currency: a prepaid tenant never moves to a tier in another.
    currency = get_tier(s, name=tenant.tier).currency
    if moves and tenant.prepaid and get_tier(s, name=str(new_tier)).currency != currency:
        raise InvalidLimits("tier", tier, "a tier in the tenant's currency while it holds prepaid credit")
    if name is not None:
        _assign(tenant, "name", name)
    if new_tier is not None:
        _assign(tenant, "tier", new_tier)
    if not isinstance(customer, _Unset):
        _assign(tenant, "stripe_customer_id", customer)
    s.flush()
    return tenant


def update_tenant_limits(
    s: Session,
    *,
    tenant_id: str,
    rpm: int | _Unset | None = UNSET,
    tpm: int | _Unset | None = UNSET,
    max_concurrent: int | _Unset | None = UNSET,
    max_tokens_cap: int | _Unset | None = UNSET,
) -> Tenant:
    """Set the tenant's own limits over its tier's: a positive integer overrides, None clears the override
    (the tier's value applies again), UNSET leaves it. Raises TenantNotFound, InvalidLimits; nothing is
    written unless every value is valid."""
    tenant = get_tenant(s, tenant_id=tenant_id)
    overrides = _given(dict(zip(LIMIT_FIELDS, (rpm, tpm, max_concurrent, max_tokens_cap), strict=True)))
    checked = {field: check_limit(field, value) for field, value in overrides.items()}
    for field, value in checked.items():
        _assign(tenant, field, value)
    s.flush()
    return tenant


def _given(values: Mapping[str, int | _Unset | None]) -> dict[str, int | None]:
    return {field: value for field, value in values.items() if not isinstance(value, _Unset)}


def _assign(row: Tier | Tenant, field: str, value: object) -> None:
    """Set only what differs, so that a no-op update leaves updated_at alone."""
    if getattr(row, field) != value:
        setattr(row, field, value)


def disable_tenant(s: Session, *, tenant_id: str) -> Tenant:
    """Disable the tenant, revoke its keys, delete its stored responses (the Responses API's) and expire its
    files (the ingress's sweep removes them with their bytes, which live in the adapter store). Idempotent:
    a second call changes nothing."""
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
        s.execute(delete(StoredResponse).where(StoredResponse.tenant_id == tenant_id))
        s.execute(delete(StorageHold).where(StorageHold.tenant_id == tenant_id))
        s.execute(
            update(StoredFile)
            .where(StoredFile.tenant_id == tenant_id, StoredFile.expires_at > now)
            .values(expires_at=now)
        )
    s.flush()
    return tenant


def lock_tenants(s: Session, *, tenant_ids: Sequence[str]) -> None:
    """Hold the tenants' rows until the transaction ends, so that writes that count a tenant's rows before
    adding to them (its batch lines in flight, its stored bytes) run one at a time per tenant, on every
    replica. PostgreSQL: FOR NO KEY UPDATE, which other rows' foreign keys to the tenant do not wait for, in
    id order (two writers never deadlock). SQLite has no row locks: there the caller writes before it counts
    (a transaction's first write takes the database's write lock until it ends)."""
    if tenant_ids:
        query = select(Tenant.id).where(Tenant.id.in_(sorted(set(tenant_ids)))).order_by(Tenant.id)
        s.execute(query.with_for_update(key_share=True)).all()


def stored_response_bytes(s: Session, *, tenant_id: str, now: datetime) -> int:
    """What the tenant's live stored responses take (their size_bytes)."""
    live = (StoredResponse.tenant_id == tenant_id) & (StoredResponse.expires_at > now)
    return int(s.scalar(select(func.coalesce(func.sum(StoredResponse.size_bytes), 0)).where(live)) or 0)


def stored_file_bytes(s: Session, *, tenant_id: str, now: datetime) -> int:
    """What the tenant's live files take."""
    live = (StoredFile.tenant_id == tenant_id) & (StoredFile.expires_at > now)
    return int(s.scalar(select(func.coalesce(func.sum(StoredFile.bytes), 0)).where(live)) or 0)


def stored_bytes(s: Session, *, tenant_id: str, now: datetime) -> int:
    """What the tenant's live stored responses and files take together (GET /v1/usage shows it)."""
    return stored_response_bytes(s, tenant_id=tenant_id, now=now) + stored_file_bytes(
        s, tenant_id=tenant_id, now=now
    )


def stored_bytes_by_tenant(s: Session, *, tenant_ids: Sequence[str], now: datetime) -> dict[str, int]:
    """stored_bytes for many tenants at once (two grouped queries); a tenant that keeps nothing is absent."""
    totals: dict[str, int] = {}
    queries = (
        select(StoredResponse.tenant_id, func.sum(StoredResponse.size_bytes))
        .where(StoredResponse.tenant_id.in_(tenant_ids), StoredResponse.expires_at > now)
        .group_by(StoredResponse.tenant_id),
        select(StoredFile.tenant_id, func.sum(StoredFile.bytes))
        .where(StoredFile.tenant_id.in_(tenant_ids), StoredFile.expires_at > now)
        .group_by(StoredFile.tenant_id),
    )
    for query in queries:
        for tenant_id, size in s.execute(query):
            totals[tenant_id] = totals.get(tenant_id, 0) + int(size or 0)
    return totals


def held_bytes(s: Session, *, tenant_id: str, now: datetime) -> int:
    """What the tenant's responses in flight hold to store (their live storage holds)."""
    live = (StorageHold.tenant_id == tenant_id) & (StorageHold.expires_at > now)
    return int(s.scalar(select(func.coalesce(func.sum(StorageHold.bytes), 0)).where(live)) or 0)


def committed_bytes(s: Session, *, tenant_id: str, now: datetime) -> int:
    """Stored and held bytes together: what the tenant's storage quota (max_stored_response_bytes) is read
    against, under its lock (lock_tenants), so that concurrent requests and uploads see each other."""
    return stored_bytes(s, tenant_id=tenant_id, now=now) + held_bytes(s, tenant_id=tenant_id, now=now)


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
    """Store a key made by app.auth.api_keys.generate_key; a disabled tenant counts as not found."""
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
    caller still verifies the hash (app.auth.api_keys.verify_key).
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
