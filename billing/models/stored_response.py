"""The stored_responses table: Responses API responses kept for retrieval and `previous_response_id`.

app/responses/store.py writes and reads it, always by (tenant, id): another tenant's response is not there.
A row holds the conversation before its request (`context`, the chain it continues, already flattened so a
continuation reads one row), the request's own input items and the response object as served.
"""

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, ForeignKey, Index, String
from sqlalchemy.orm import Mapped, mapped_column

from billing.models.base import Base, UTCDateTime, utcnow


class StoredResponse(Base):
    """One response of POST /v1/responses with store true, until it expires or its tenant is disabled."""

    __tablename__ = "stored_responses"
    __table_args__ = (Index("ix_stored_responses_tenant_expires", "tenant_id", "expires_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    model: Mapped[str] = mapped_column(String(256))  # as the client named it
    previous_response_id: Mapped[str | None] = mapped_column(String(64))
    context: Mapped[list[dict[str, Any]]] = mapped_column(JSON)  # items before this request's input
    input_items: Mapped[list[dict[str, Any]]] = mapped_column(JSON)  # this request's, with their ids
    body: Mapped[dict[str, Any]] = mapped_column(JSON)  # the response object as served
    size_bytes: Mapped[int] = mapped_column(BigInteger)  # the three JSON columns together
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
