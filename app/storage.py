"""A tenant's stored bytes, against its tier's quota (`max_stored_response_bytes`): its live stored responses
and its live files share it (issue 37)."""

from dataclasses import dataclass
from datetime import datetime
from typing import Protocol


class ByteKeeper(Protocol):
    """A store of a tenant's bytes (app/responses/store.py, app/files/store.py): read by its shape, so this
    module, which both of their routes use, depends on neither."""

    def stored_bytes(self, tenant_id: str, now: datetime | None = None) -> int: ...


@dataclass(frozen=True)
class StoredBytes:
    responses: int
    files: int

    @property
    def total(self) -> int:
        return self.responses + self.files


def stored_bytes(
    responses: ByteKeeper, files: ByteKeeper, tenant_id: str, now: datetime | None = None
) -> StoredBytes:
    """What the tenant keeps now (two queries; run it in the thread pool)."""
    return StoredBytes(responses.stored_bytes(tenant_id, now), files.stored_bytes(tenant_id, now))
