"""The storage_holds table: bytes that responses in flight will store, counted against their tenant's
storage quota (issue 35) from the moment the request is admitted until its response is stored (the row
then counts instead) or the request ends without storing.

Without holds every request checked the quota against what was stored before it, so a tenant's concurrent
requests each saw the same total and together passed the quota by what they stored. A hold is taken in the
same transaction as the count, under the tenant's lock (billing.repository.lock_tenants), so concurrent
requests and file uploads see each other. A hold outlives no request: it expires (a replica that died
mid-request cannot keep it) and the stored responses' sweep deletes expired ones.
"""

from datetime import datetime

from sqlalchemy import BigInteger, ForeignKey, Index, String
from sqlalchemy.orm import Mapped, mapped_column

from billing.models.base import Base, UTCDateTime


class StorageHold(Base):
    """What one Responses request with store true may store: its estimate, until the response is stored."""

    __tablename__ = "storage_holds"
    __table_args__ = (
        Index("ix_storage_holds_tenant_expires", "tenant_id", "expires_at"),  # a tenant's live holds
        Index("ix_storage_holds_expires", "expires_at"),  # the sweep
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # the response id it will be stored as
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    bytes: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
