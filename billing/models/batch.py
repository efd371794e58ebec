"""The batches table: the Batch API's batches (issue 37), one row each, with their status and counts.

A batch is created `in_progress` once its whole input file validated (its lines are then in batch_lines,
billing/models/batch_line.py), or `failed` with line-numbered `errors` (no lines stored). The runner moves
it on: `finalizing` when no line is left queued or running, then `completed` with its output and error files
(`output_file_id`, `error_file_id`); `cancelling` then `cancelled`; `expired` past `expires_at`. Each status
change stamps its time column. `request_counts` are the runner's to keep (total is set at creation).
"""

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, CheckConstraint, ForeignKey, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from billing.models.base import Base, UTCDateTime, utcnow

BATCH_STATUSES = (
    "validating",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "expired",
    "cancelling",
    "cancelled",
)
ACTIVE_BATCH_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")  # count against the limit
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


class Batch(Base):
    """One batch of a tenant: its input file's requests against one endpoint, within its window."""

    __tablename__ = "batches"
    __table_args__ = (
        CheckConstraint(
            "status IN ('validating', 'in_progress', 'finalizing', 'completed', 'failed', 'expired', "
            "'cancelling', 'cancelled')",
            name="status",
        ),  # BATCH_STATUSES
        Index("ix_batches_tenant_created", "tenant_id", "created_at"),  # listing, newest first
        Index("ix_batches_status", "status"),  # the runner's: batches in progress or being cancelled
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # batch_<24 base32>
    tenant_id: Mapped[str] = mapped_column(String(32), ForeignKey("tenants.id"))
    key_id: Mapped[str] = mapped_column(String(32))  # the API key that created it: its lines are metered so
    endpoint: Mapped[str] = mapped_column(String(32))
    input_file_id: Mapped[str] = mapped_column(String(64))  # the file may be deleted since: lines are here
    completion_window: Mapped[str] = mapped_column(String(8))
    status: Mapped[str] = mapped_column(String(16))
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)  # [{code, message, param, line}]
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    total: Mapped[int] = mapped_column(Integer, default=0)  # request_counts
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)  # created_at + completion_window
    in_progress_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    expired_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
