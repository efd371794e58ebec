"""The tiers table: price points, with the rate limits they sell and the prices they charge."""

from datetime import datetime
from decimal import Decimal

from sqlalchemy import BigInteger, CheckConstraint, Double, Integer, Numeric, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from billing.models.base import Base, UTCDateTime, utcnow

# The limit columns a tier sets and a tenant may override (Tenant has the same four).
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
    # Its tenants' share of an engine replica while they wait, against other tenants' (fair admission).
    weight: Mapped[float] = mapped_column(Double, default=1.0)
    # The most its tenants may each keep in stored responses (their size_bytes, live rows); NULL: no bound.
    max_stored_response_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # A Batch API line's cost is its price times this (issue 37): batch work on idle capacity, cheaper.
    batch_price_factor: Mapped[Decimal] = mapped_column(Numeric(6, 4), default=Decimal("0.5"))
    # Per GB (10^9 bytes) of stored responses and files a day, charged hourly (app/storage_billing.py).
    price_storage_per_gb_day: Mapped[Decimal] = mapped_column(Numeric(18, 6), default=Decimal(0))
