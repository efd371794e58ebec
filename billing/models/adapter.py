"""The adapter registry's tables: adapters (a name per owner) and adapter_versions (its validated uploads)."""

from datetime import datetime

from sqlalchemy import JSON, BigInteger, Boolean, ForeignKey, Index, Integer, String, text
from sqlalchemy.orm import Mapped, mapped_column

from billing.models.base import Base, UTCDateTime, new_id, utcnow

PUBLIC_OWNER = "public"  # owner of adapters every tenant may use


class Adapter(Base):
    """One named adapter of one owner (a tenant id, or "public"); its weights live in AdapterVersion rows.

    Deleting sets deleted_at and never removes the row: usage history keeps pointing at it. Names are unique
    per owner among live adapters only, so a deleted name can be uploaded afresh (as a new adapter id).
    """

    __tablename__ = "adapters"
    __table_args__ = (
        Index(
            "ix_adapters_owner_name_live",
            "owner",
            "name",
            unique=True,
            sqlite_where=text("deleted_at IS NULL"),
            postgresql_where=text("deleted_at IS NULL"),
        ),
        Index("ix_adapters_base_model", "base_model"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("ad"))
    name: Mapped[str] = mapped_column(String(64))
    owner: Mapped[str] = mapped_column(String(32))
    base_model: Mapped[str] = mapped_column(String(128))
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class AdapterVersion(Base):
    """One immutable, validated upload; `version` equals the adapter store's version of the files."""

    __tablename__ = "adapter_versions"

    adapter_id: Mapped[str] = mapped_column(String(32), ForeignKey("adapters.id"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    rank: Mapped[int] = mapped_column(Integer)
    target_modules: Mapped[list[str]] = mapped_column(JSON)
    sha256: Mapped[str] = mapped_column(String(64))  # of adapter_model.safetensors
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
