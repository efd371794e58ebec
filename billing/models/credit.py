"""Money a tenant holds and may spend: the prepaid credit ledger, spend limits per period, and the
once-per-period budget events (a soft limit crossed).

The ledger is append-only: a top-up or adjustment is a new row naming who made it and why, and the credit
balance is the sum of the rows minus the settled cost of the tenant's usage rows (usage_events.cost).
"""

from datetime import datetime
from decimal import Decimal

from sqlalchemy import Boolean, CheckConstraint, ForeignKey, Numeric, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from billing.models.base import Base, UTCDateTime, new_id, utcnow

PERIODS = ("day", "month")  # UTC calendar periods a spend limit covers
SURFACES = ("admin_api", "cli")  # where a credit entry was made: the admin API, or the CLI through it


class CreditEntry(Base):
    """One change of a tenant's prepaid credit: a top-up (> 0) or an adjustment (either sign)."""

    __tablename__ = "credit_entries"
    __table_args__ = (
        CheckConstraint("kind IN ('topup', 'adjustment')", name="kind"),
        CheckConstraint("surface IN ('admin_api', 'cli')", name="surface"),  # SURFACES
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("cre"))
    tenant_id: Mapped[str] = mapped_column(String(32), ForeignKey("tenants.id"), index=True)
    amount: Mapped[Decimal] = mapped_column(Numeric(18, 6))
    currency: Mapped[str] = mapped_column(String(3))
    kind: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text, default="")
    actor: Mapped[str] = mapped_column(String(128))  # who made it, as the caller said (free text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # What the server saw, beside what the caller said: the request that wrote it (our request id, in the
    # logs with the admin key's use) and its surface. NULL: written directly, or before 0011.
    request_id: Mapped[str | None] = mapped_column(String(64))
    surface: Mapped[str | None] = mapped_column(String(16))


class SpendLimit(Base):
    """A tenant's limit on what it may spend per UTC day or month: hard refuses, soft only warns."""

    __tablename__ = "spend_limits"
    __table_args__ = (CheckConstraint("period IN ('day', 'month')", name="period"),)

    tenant_id: Mapped[str] = mapped_column(String(32), ForeignKey("tenants.id"), primary_key=True)
    period: Mapped[str] = mapped_column(String(8), primary_key=True)
    amount: Mapped[Decimal] = mapped_column(Numeric(18, 6))
    hard: Mapped[bool] = mapped_column(Boolean, default=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class BudgetEvent(Base):
    """Something about a tenant's budget worth telling it once per period (a soft limit crossed)."""

    __tablename__ = "budget_events"
    __table_args__ = (UniqueConstraint("tenant_id", "period_key", "kind", name="uq_budget_events_once"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("bev"))
    tenant_id: Mapped[str] = mapped_column(String(32), ForeignKey("tenants.id"), index=True)
    period_key: Mapped[str] = mapped_column(String(16))  # "day:2026-11-27" or "month:2026-11"
    kind: Mapped[str] = mapped_column(String(16))  # "soft_limit"
    detail: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
