"""The batch_lines table: one row per request line of a batch that passed validation (issue 37).

The runner claims lines with leases: it sets `state` 'running', `lease_owner` (its own id) and
`lease_expires_at` in one conditional UPDATE of queued lines (or running ones whose lease ran out: their
owner died, counted in `lost`), renews the lease while a line runs, and ends a line 'done' (its
`response`: the status code and body that go to the output file) or 'failed' (its `error`: the error
file's). `request_id` is fixed by the batch id and the custom_id (app/batches/lines.py), so a line run
twice is metered once.
"""

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, CheckConstraint, ForeignKey, Index, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from billing.models.base import Base, UTCDateTime

LINE_STATES = ("queued", "running", "done", "failed")
PREFIX_CHARS = 256


class BatchLine(Base):
    """One request of a batch: its body as sent, and where it stands."""

    __tablename__ = "batch_lines"
    __table_args__ = (
        CheckConstraint("state IN ('queued', 'running', 'done', 'failed')", name="state"),  # LINE_STATES
        UniqueConstraint("batch_id", "custom_id", name="uq_batch_lines_custom_id"),
        # Claims (a batch's queued lines in claim order, read off the index; running ones whose lease ran
        # out) and counts per batch and state (its prefix). No more indexes: each costs a 50,000-line
        # batch's creation time (request_id is unique by construction: a hash of the batch id and the
        # unique custom_id).
        Index("ix_batch_lines_claim", "batch_id", "state", "model", "prefix", "line"),
    )

    batch_id: Mapped[str] = mapped_column(String(64), ForeignKey("batches.id"), primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)  # 1-based, in the file
    custom_id: Mapped[str] = mapped_column(String(512))
    request_id: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(256))  # body.model, for grouping lines by adapter
    # The opening of the prompt (app/batches/lines.py: prompt_prefix): lines are claimed in its order within
    # a model, so lines that share a prompt's start run together and prefill it once (the prefix cache).
    prefix: Mapped[str] = mapped_column(String(PREFIX_CHARS), default="")
    body: Mapped[dict[str, Any]] = mapped_column(JSON)  # as sent; valid for the batch's endpoint
    state: Mapped[str] = mapped_column(String(16), default="queued")
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # claims so far
    lost: Mapped[int] = mapped_column(Integer, default=0)  # claims whose runner stopped (its lease lapsed)
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    response: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # done: {"status_code", "body"}
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # failed: {"code", "message"}
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
