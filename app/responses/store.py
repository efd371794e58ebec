"""ResponseStore: stored responses in the platform database, always read and written by (tenant, id).

Another tenant's id, an expired response and a deleted one all read as missing, so a 404 tells nothing
about other tenants. Expired rows of a tenant are removed whenever it stores a new one; a disabled tenant's
are removed with it (billing.repository.disable_tenant). Sessions are synchronous: callers run these in
the thread pool.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from app.settings import ResponsesConfig
from billing.models import StoredResponse, utcnow


@dataclass(frozen=True)
class Stored:
    """A stored response, as read: what retrieval and continuation need."""

    id: str
    context: list[dict[str, Any]]
    input_items: list[dict[str, Any]]
    body: dict[str, Any]

    def chain(self) -> list[dict[str, Any]]:
        """The conversation a continuation of this response starts from: its context, input and output."""
        return [*self.context, *self.input_items, *self.body.get("output", [])]


class ResponseStore:
    def __init__(self, sessions: Callable[[], Session], config: ResponsesConfig) -> None:
        self.sessions = sessions
        self.config = config

    def get(self, tenant_id: str, response_id: str, now: datetime | None = None) -> Stored | None:
        with self.sessions() as s:
            row = s.scalar(
                select(StoredResponse).where(
                    StoredResponse.id == response_id,
                    StoredResponse.tenant_id == tenant_id,
                    StoredResponse.expires_at > (now or utcnow()),
                )
            )
            if row is None:
                return None
            return Stored(row.id, row.context, row.input_items, row.body)

    def save(
        self,
        tenant_id: str,
        body: dict[str, Any],
        context: list[dict[str, Any]],
        input_items: list[dict[str, Any]],
    ) -> None:
        now = utcnow()
        size = sum(len(json.dumps(v, separators=(",", ":"))) for v in (body, context, input_items))
        with self.sessions() as s, s.begin():
            s.execute(
                delete(StoredResponse).where(
                    StoredResponse.tenant_id == tenant_id, StoredResponse.expires_at <= now
                )
            )
            s.add(
                StoredResponse(
                    id=body["id"],
                    tenant_id=tenant_id,
                    model=body["model"],
                    previous_response_id=body.get("previous_response_id"),
                    context=context,
                    input_items=input_items,
                    body=body,
                    size_bytes=size,
                    created_at=now,
                    expires_at=now + timedelta(days=self.config.retention_days),
                )
            )

    def delete(self, tenant_id: str, response_id: str) -> bool:
        """Whether there was such a response (expired ones are gone already)."""
        now = utcnow()
        with self.sessions() as s, s.begin():
            result = s.execute(
                delete(StoredResponse).where(
                    StoredResponse.id == response_id,
                    StoredResponse.tenant_id == tenant_id,
                    StoredResponse.expires_at > now,
                )
            )
            return bool(getattr(result, "rowcount", 0))
