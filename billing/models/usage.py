"""The metering tables: usage_events (one row per metered request) and usage_rollups (their hourly sums).

billing.usage writes both (the rollups from the events); billing.usage_queries reads the events, and
billing.pricing and billing.stripe_export read the rollups.
"""

from datetime import datetime
from decimal import Decimal

from sqlalchemy import BigInteger, CheckConstraint, Double, Index, Integer, Numeric, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from billing.models.base import Base, UTCDateTime, utcnow

BASE_ADAPTER_KEY = "base"  # a rollup's adapter_key for requests to the base model
# The base model of the hourly storage charges (app.storage_billing): usage rows that are not requests.
STORAGE_MODEL = "storage"


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
    # What the request cost, fixed when it was settled at the prices in force then (billing.price_book);
    # NULL only for rows recorded by a version that did not price them.
    cost: Mapped[Decimal | None] = mapped_column(Numeric(18, 6))
    currency: Mapped[str | None] = mapped_column(String(3))
    batch_id: Mapped[str | None] = mapped_column(String(64))  # a Batch API line's batch (migration 0015)


class UsageRollup(Base):
    """A tenant's usage of one adapter (or the base model) during one UTC hour, in one currency (a postpaid
    tenant's tier may change currency within an hour). The id is derived from that key when the row is
    made; recomputing an hour finds the row by its key and keeps its id, so Stripe identifiers stay stable
    (rows from before 0011 keep ids derived without the currency)."""

    __tablename__ = "usage_rollups"
    __table_args__ = (
        UniqueConstraint(
            "tenant_id", "adapter_key", "base_model", "hour", "currency", name="uq_usage_rollups_key"
        ),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(32), index=True)
    adapter_key: Mapped[str] = mapped_column(String(64))  # an adapter id, or BASE_ADAPTER_KEY
    base_model: Mapped[str] = mapped_column(String(128))
    hour: Mapped[datetime] = mapped_column(UTCDateTime)
    requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    gpu_ms: Mapped[float] = mapped_column(Double)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    # The usage rows' settled costs summed, in micro-units of `currency` (a row settled without a cost
    # counts at the price history's prices). NULL: not computed since the column came (0008).
    cost_micros: Mapped[int | None] = mapped_column(BigInteger)
    # Its rows' currency (a row settled without one: the price history's); "xxx" (ISO 4217: none) when no
    # price covers them.
    currency: Mapped[str] = mapped_column(String(3))
