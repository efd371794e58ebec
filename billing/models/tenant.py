"""The tenants table: a customer on a tier (tiers.name), with optional overrides of the tier's limits."""

from datetime import datetime
from enum import StrEnum

from sqlalchemy import BigInteger, Boolean, CheckConstraint, ForeignKey, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from billing.models.base import Base, UTCDateTime, new_id, utcnow


class TenantStatus(StrEnum):
    ACTIVE = "active"
    DISABLED = "disabled"


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
    # Per-tenant overrides of the tier's limits (tier.LIMIT_FIELDS); NULL: the tier's value.
    rpm: Mapped[int | None] = mapped_column(Integer)
    tpm: Mapped[int | None] = mapped_column(BigInteger)
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    max_tokens_cap: Mapped[int | None] = mapped_column(Integer)
    stripe_customer_id: Mapped[str | None] = mapped_column(String(64))  # where its usage is billed
    # Prepaid: it is served only while its credit (billing.models.credit) covers the worst case.
    prepaid: Mapped[bool] = mapped_column(Boolean, default=False)
    # When its first credit was granted: its usage from that UTC hour on is paid from credit, the hours
    # before were invoiced (billing.stripe_export), so the balance counts usage from then. None: postpaid.
    prepaid_since: Mapped[datetime | None] = mapped_column(UTCDateTime)
