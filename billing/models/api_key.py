"""The api_keys table: a tenant's (tenants.id) keys, stored as a public prefix and an HMAC, never in clear."""

from datetime import datetime

from sqlalchemy import ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from billing.models.base import Base, UTCDateTime, new_id, utcnow


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("key"))
    tenant_id: Mapped[str] = mapped_column(String(32), ForeignKey("tenants.id"), index=True)
    name: Mapped[str | None] = mapped_column(String(128))
    prefix: Mapped[str] = mapped_column(String(12), unique=True, index=True)  # public (app/auth/api_keys.py)
    key_hash: Mapped[str] = mapped_column(String(64))  # HMAC-SHA256 hex; the key itself is never stored
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
