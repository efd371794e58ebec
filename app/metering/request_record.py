"""RequestRecord and RequestObserver: what the ingress reports when a request ends, and who listens.

Every request that reached an engine ends in exactly one record (completed, aborted by the client, or
failed), which metering turns into a usage event.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Literal, Protocol

from adapters.ref import AdapterRef
from deployments.engine.interface import RequestUsage

log = logging.getLogger(__name__)
RequestStatus = Literal["completed", "aborted", "failed"]


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    tenant_id: str
    key_id: str
    model: str  # as the client named it
    base_model: str
    adapter: AdapterRef | None  # the version it ran on; None for the base model
    status: RequestStatus
    finish_reason: str | None
    usage: RequestUsage | None  # what the engine measured; None if it never answered
    started_at: datetime
    latency_ms: float
    stream: bool
    cost: Decimal | None = None  # settled at admission's prices (app/budgets/guard.py); None: not priced
    currency: str | None = None
    batch_id: str | None = None  # a Batch API line's batch


class RequestObserver(Protocol):
    async def on_finish(self, record: RequestRecord) -> None: ...


async def tell(observers: Sequence[RequestObserver], record: RequestRecord) -> None:
    """Hand `record` to every observer; one that fails is logged and the others still hear of it."""
    for observer in observers:
        try:
            await observer.on_finish(record)
        except Exception:  # an observer must never break a response
            log.exception("observer %r failed on %s", observer, record.request_id)
