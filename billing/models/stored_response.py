"""The stored_responses table: Responses API responses kept for retrieval and `previous_response_id`.

app/responses/store.py writes and reads it, always by (tenant, id): another tenant's response is not there.
A row holds its request's own input items and the response object as served, and the conversation before
its request either by reference (`context_from`: the predecessor whose chain it continues, less that
chain's first `context_skip` items; issue 35) or itself (`context`, flattened: a first response, one
whose predecessor was gone when it was stored, or one `depth` hops from the last flattened row).
"""

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, ForeignKey, Index, Integer, String, false
from sqlalchemy.orm import Mapped, mapped_column

from billing.models.base import Base, UTCDateTime, utcnow


class StoredResponse(Base):
    """One response of POST /v1/responses with store true, until it expires or its tenant is disabled."""

    __tablename__ = "stored_responses"
    __table_args__ = (
        Index("ix_stored_responses_tenant_expires", "tenant_id", "expires_at"),  # reads by tenant
        Index("ix_stored_responses_expires", "expires_at"),  # the sweep of every tenant's expired rows
        Index("ix_stored_responses_context_from", "context_from"),  # a deleted row's successors
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    model: Mapped[str] = mapped_column(String(256))  # as the client named it
    previous_response_id: Mapped[str | None] = mapped_column(String(64))
    context: Mapped[list[dict[str, Any]]] = mapped_column(
        JSON
    )  # items before its input, when not by reference
    context_from: Mapped[str | None] = mapped_column(String(64))  # the predecessor its context continues
    context_skip: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # of its chain, dropped
    depth: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # hops to a flattened row
    deleted: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())  # kept as a link
    input_items: Mapped[list[dict[str, Any]]] = mapped_column(JSON)  # this request's, with their ids
    body: Mapped[dict[str, Any]] = mapped_column(JSON)  # the response object as served
    size_bytes: Mapped[int] = mapped_column(BigInteger)  # the three JSON columns together: its own bytes
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
