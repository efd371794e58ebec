"""Effective-dated prices: a tier's prices, a tenant's overrides, and prices for one base model or adapter.

A row applies from `effective_from` until a later row of the same scope takes over; nothing is ever
updated, so the prices in force at any moment stay readable (billing.price_book resolves them).
"""

from datetime import datetime
from decimal import Decimal

from sqlalchemy import Index, Numeric, String
from sqlalchemy.orm import Mapped, mapped_column

from billing.models.base import Base, UTCDateTime, new_id, utcnow


class PriceChange(Base):
    """Prices from `effective_from` on, for a scope: a tier, or a tenant; either narrowed to one base
    model or one adapter (NULL: every one)."""

    __tablename__ = "price_changes"
    __table_args__ = (Index("ix_price_changes_scope", "tier", "tenant_id", "effective_from"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("prc"))
    tier: Mapped[str | None] = mapped_column(String(64))
    tenant_id: Mapped[str | None] = mapped_column(String(32))
    base_model: Mapped[str | None] = mapped_column(String(128))
    adapter_id: Mapped[str | None] = mapped_column(String(32))
    effective_from: Mapped[datetime] = mapped_column(UTCDateTime)
    input_per_mtok: Mapped[Decimal] = mapped_column(Numeric(18, 6))
    cached_input_per_mtok: Mapped[Decimal] = mapped_column(Numeric(18, 6))
    output_per_mtok: Mapped[Decimal] = mapped_column(Numeric(18, 6))
    gpu_per_second: Mapped[Decimal] = mapped_column(Numeric(18, 6))
    currency: Mapped[str] = mapped_column(String(3))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
