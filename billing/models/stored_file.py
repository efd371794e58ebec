"""The files table: the Files API's files (issue 37), their metadata; the bytes live in the adapter store's
backend under `.files/` (app/files/blobs.py), one object per file, named by the row's `blob` key.

A tenant's file is read, listed and deleted by (tenant, id) only, and an expired row reads as missing until
the sweep removes it and its bytes. `bytes` counts against the tenant's storage quota (the tier's
`max_stored_response_bytes`, shared with stored responses).
"""

from datetime import datetime

from sqlalchemy import BigInteger, CheckConstraint, ForeignKey, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from billing.models.base import Base, UTCDateTime, utcnow

FILE_PURPOSES = ("batch", "batch_output")  # uploaded by tenants; written by the batch runner


class StoredFile(Base):
    """One file: a tenant's batch input (uploaded) or a batch's output or error file (ours)."""

    __tablename__ = "files"
    __table_args__ = (
        CheckConstraint("purpose IN ('batch', 'batch_output')", name="purpose"),  # FILE_PURPOSES
        Index("ix_files_tenant_created", "tenant_id", "created_at"),  # listing, newest first
        Index("ix_files_expires", "expires_at"),  # the sweep of every tenant's expired files
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # file-<24 base32>
    tenant_id: Mapped[str] = mapped_column(String(32), ForeignKey("tenants.id"))
    purpose: Mapped[str] = mapped_column(String(16))
    filename: Mapped[str] = mapped_column(String(255))  # as the client named it; metadata only
    bytes: Mapped[int] = mapped_column(BigInteger)
    lines: Mapped[int] = mapped_column(Integer)  # JSONL lines (non-empty)
    blob: Mapped[str] = mapped_column(String(128))  # the object's key under the store's .files/ prefix
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
