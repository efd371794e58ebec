"""Billing tables as SQLAlchemy 2 models: tiers, tenants, their API keys, and the adapter registry.

Migrations are written by hand in migrations/versions/; tests/billing/test_migrations.py compares the two
with Alembic's autogenerate so they cannot drift.
"""

import secrets
from datetime import UTC, datetime
from decimal import Decimal
from enum import StrEnum

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Numeric,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

# Deterministic constraint names: Alembic can then drop or alter them by name on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz234567"  # lowercase base32


def new_id(kind: str) -> str:
    """`<kind>_` and 20 base32 characters (100 random bits)."""
    return f"{kind}_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(20))


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Aware datetimes in, aware UTC datetimes out, stored as UTC.

    Naive values are refused rather than guessed at. SQLite keeps no offset, so UTC is attached on read.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value.isoformat()} given; use an aware (UTC) datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class TenantStatus(StrEnum):
    ACTIVE = "active"
    DISABLED = "disabled"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


LIMIT_FIELDS = ("rpm", "tpm", "max_concurrent", "max_tokens_cap")  # NULL: unlimited


class Tier(Base):
    """A price point: what it sells as rates (requests and tokens per minute, concurrency, largest request)
    and what happens over them (reject with 429, or queue for up to max_queue_ms)."""

    __tablename__ = "tiers"
    __table_args__ = (CheckConstraint("on_limit IN ('reject', 'queue')", name="on_limit"),)

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    description: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    rpm: Mapped[int | None] = mapped_column(Integer)
    tpm: Mapped[int | None] = mapped_column(BigInteger)
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    max_tokens_cap: Mapped[int | None] = mapped_column(Integer)
    on_limit: Mapped[str] = mapped_column(String(8), default="reject")
    max_queue_ms: Mapped[int] = mapped_column(Integer, default=0)
    # Prices (in `currency`): per million input / cached input / output tokens, and per GPU-second.
    price_input_per_mtok: Mapped[Decimal] = mapped_column(Numeric(18, 6), default=Decimal(0))
    price_cached_input_per_mtok: Mapped[Decimal] = mapped_column(Numeric(18, 6), default=Decimal(0))
    price_output_per_mtok: Mapped[Decimal] = mapped_column(Numeric(18, 6), default=Decimal(0))
    price_gpu_per_second: Mapped[Decimal] = mapped_column(Numeric(18, 6), default=Decimal(0))
    currency: Mapped[str] = mapped_column(String(3), default="usd")


class Tenant(Base):
    __tablename__ = "tenants"
    __table_args__ = (
        CheckConstraint("status IN ('active', 'disabled')", name="status"),  # TenantStatus
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("ten"))
    name: Mapped[str] = mapped_column(String(128), unique=True)
    tier: Mapped[str] = mapped_column(String(64), ForeignKey("tiers.name", onupdate="CASCADE"))
    status: Mapped[str] = mapped_column(String(16), default=TenantStatus.ACTIVE.value)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    disabled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # Per-tenant overrides of the tier's limits; NULL: the tier's value.
    rpm: Mapped[int | None] = mapped_column(Integer)
    tpm: Mapped[int | None] = mapped_column(BigInteger)
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    max_tokens_cap: Mapped[int | None] = mapped_column(Integer)
    stripe_customer_id: Mapped[str | None] = mapped_column(String(64))  # where its usage is billed


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("key"))
    tenant_id: Mapped[str] = mapped_column(String(32), ForeignKey("tenants.id"), index=True)
    name: Mapped[str | None] = mapped_column(String(128))
    prefix: Mapped[str] = mapped_column(String(12), unique=True, index=True)  # app.auth's public prefix
    key_hash: Mapped[str] = mapped_column(String(64))  # HMAC-SHA256 hex; the key itself is never stored
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


PUBLIC_OWNER = "public"  # owner of adapters every tenant may use


class Adapter(Base):
    """One named adapter of one owner (a tenant id, or "public"); its weights live in AdapterVersion rows.

    Deleting sets deleted_at and never removes the row: usage history keeps pointing at it. Names are unique
    per owner among live adapters only, so a deleted name can be uploaded afresh (as a new adapter id).
    """

    __tablename__ = "adapters"
    __table_args__ = (
        Index(
            "ix_adapters_owner_name_live",
            "owner",
            "name",
            unique=True,
            sqlite_where=text("deleted_at IS NULL"),
            postgresql_where=text("deleted_at IS NULL"),
        ),
        Index("ix_adapters_base_model", "base_model"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("ad"))
    name: Mapped[str] = mapped_column(String(64))
    owner: Mapped[str] = mapped_column(String(32))
    base_model: Mapped[str] = mapped_column(String(128))
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class AdapterVersion(Base):
    """One immutable, validated upload; `version` equals the adapter store's version of the files."""

    __tablename__ = "adapter_versions"

    adapter_id: Mapped[str] = mapped_column(String(32), ForeignKey("adapters.id"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    rank: Mapped[int] = mapped_column(Integer)
    target_modules: Mapped[list[str]] = mapped_column(JSON)
    sha256: Mapped[str] = mapped_column(String(64))  # of adapter_model.safetensors
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class UsageEvent(Base):
    """One request that reached an engine, as metered: written once (insert-or-ignore on request_id)."""

    __tablename__ = "usage_events"
    __table_args__ = (
        CheckConstraint("status IN ('completed', 'aborted', 'failed')", name="status"),
        Index("ix_usage_events_tenant_started", "tenant_id", "started_at"),
    )

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(32))
    key_id: Mapped[str] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(200))  # as the client named it
    base_model: Mapped[str] = mapped_column(String(128))
    adapter_id: Mapped[str | None] = mapped_column(String(32))
    adapter_version: Mapped[int | None] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer)  # part of prompt_tokens, as in OpenAI's usage
    completion_tokens: Mapped[int] = mapped_column(Integer)
    gpu_ms: Mapped[float] = mapped_column(Double)
    queue_ms: Mapped[float] = mapped_column(Double)
    ttft_ms: Mapped[float | None] = mapped_column(Double)
    latency_ms: Mapped[float] = mapped_column(Double)
    replica: Mapped[str | None] = mapped_column(String(128))  # the engine replica that served it
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime] = mapped_column(UTCDateTime)
    recorded_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class UsageRollup(Base):
    """A tenant's usage of one adapter (or the base model) during one UTC hour. The id is derived from
    that key, so recomputing an hour updates the same row and Stripe identifiers stay stable."""

    __tablename__ = "usage_rollups"
    __table_args__ = (
        UniqueConstraint("tenant_id", "adapter_key", "base_model", "hour", name="uq_usage_rollups_key"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(32), index=True)
    adapter_key: Mapped[str] = mapped_column(String(64))  # an adapter id, or "base"
    base_model: Mapped[str] = mapped_column(String(128))
    hour: Mapped[datetime] = mapped_column(UTCDateTime)
    requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    gpu_ms: Mapped[float] = mapped_column(Double)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class StripeExport(Base):
    """One meter event sent (or to send) to Stripe: the increase of one rollup's meter since the last
    export. `identifier` is deterministic (rollup, meter, revision), so a replay is deduplicated by Stripe."""

    __tablename__ = "stripe_exports"
    __table_args__ = (
        CheckConstraint("status IN ('pending', 'sent', 'failed', 'skipped')", name="status"),
        Index("ix_stripe_exports_rollup_meter", "rollup_id", "meter"),
    )

    identifier: Mapped[str] = mapped_column(String(128), primary_key=True)
    rollup_id: Mapped[str] = mapped_column(String(32), ForeignKey("usage_rollups.id"))
    meter: Mapped[str] = mapped_column(String(64))  # the Stripe meter's event_name
    revision: Mapped[int] = mapped_column(Integer)
    value: Mapped[int] = mapped_column(BigInteger)
    customer: Mapped[str] = mapped_column(String(64))
    timestamp: Mapped[datetime] = mapped_column(UTCDateTime)  # the event time sent to Stripe
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    sent_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class EngineReport(Base):
    """An engine replica's cumulative busy and wall time (utilisation) and routing quality."""

    __tablename__ = "engine_reports"

    replica: Mapped[str] = mapped_column(String(128), primary_key=True)
    base_model: Mapped[str] = mapped_column(String(128))
    busy_ms: Mapped[float] = mapped_column(Double)
    wall_ms: Mapped[float] = mapped_column(Double)
    steps: Mapped[int] = mapped_column(BigInteger)
    adapter_requests: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    adapter_hits: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")  # found resident
    adapter_loads: Mapped[dict[str, int] | None] = mapped_column(JSON)  # "name@vN" -> reads from the store
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
