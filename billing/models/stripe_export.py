"""The stripe_exports table: the meter events sent (or to send) to Stripe, one per rollup, meter and revision.

billing.stripe_export writes and sends them.
"""

from datetime import datetime

from sqlalchemy import BigInteger, CheckConstraint, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from billing.models.base import Base, UTCDateTime, utcnow


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
