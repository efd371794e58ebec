"""FileStore: the Files API's files, their metadata in the platform database (billing/models/stored_file.py)
and their bytes in the adapter store's backend (app/files/blobs.py), always read by (tenant, id).

Another tenant's id, an expired file and a deleted one all read as missing, so a 404 tells nothing about
other tenants. A file's bytes are stored before its row is committed and removed after its row is deleted,
so a row always names whole bytes. Expired files read as missing at once and are removed by `sweep`, which
every ingress runs on a timer (app/sweeper.py). Sessions are synchronous: callers run these in the thread
pool.
"""

import logging
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sqlalchemy import Select, delete, select
from sqlalchemy.orm import Session

from adapters.errors import AdapterStoreUnavailable
from app.cursor_page import Order, beyond
from app.files.blobs import FileBlobs
from billing.models import StoredFile, utcnow
from billing.repository import committed_bytes, lock_tenants, stored_file_bytes

log = logging.getLogger(__name__)

CHUNK_BYTES = 256 * 1024  # a file's content is read and sent this much at a time
_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz234567"


def new_file_id() -> str:
    """`file-` and 24 base32 characters (120 random bits), as OpenAI's ids look."""
    return "file-" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class FileRecord:
    """A file, as read: what the API answers with, and its blob's key."""

    id: str
    tenant_id: str
    purpose: str
    filename: str
    bytes: int
    lines: int
    blob: str
    created_at: datetime
    expires_at: datetime

    @classmethod
    def of(cls, row: StoredFile) -> "FileRecord":
        return cls(
            row.id,
            row.tenant_id,
            row.purpose,
            row.filename,
            row.bytes,
            row.lines,
            row.blob,
            row.created_at,
            row.expires_at,
        )

    def to_api(self) -> dict[str, object]:
        """OpenAI's file object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": int(self.created_at.timestamp()),
            "expires_at": int(self.expires_at.timestamp()),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


class QuotaExceeded(Exception):
    """The file would take its tenant past its storage quota."""

    def __init__(self, used: int, needed: int, quota: int) -> None:
        super().__init__(f"{used} + {needed} > {quota}")
        self.used, self.needed, self.quota = used, needed, quota


class FileStore:
    def __init__(self, sessions: Callable[[], Session], blobs: FileBlobs) -> None:
        self.sessions = sessions
        self.blobs = blobs

    def create(
        self,
        tenant_id: str,
        *,
        purpose: str,
        filename: str,
        source: Path,
        size: int,
        lines: int,
        expires_at: datetime,
        quota: int | None = None,
    ) -> FileRecord:
        """Store the local file `source` as a new file of the tenant (the batch runner writes its output
        files with this too, purpose batch_output). The bytes first, then the row; if the row cannot be
        written the bytes go again. With a `quota`, the row is written only if the tenant's stored bytes
        (responses and files) with it stay within it, else QuotaExceeded: counted in the row's transaction
        under the tenant's lock, so concurrent uploads cannot pass it together."""
        file_id = new_file_id()
        key = self.blobs.key(tenant_id, file_id)
        self.blobs.put(key, source)
        row = StoredFile(
            id=file_id,
            tenant_id=tenant_id,
            purpose=purpose,
            filename=filename,
            bytes=size,
            lines=lines,
            blob=key,
            created_at=utcnow(),
            expires_at=expires_at,
        )
        try:
            with self.sessions() as s, s.begin():
                lock_tenants(s, tenant_ids=[tenant_id])
                s.add(row)
                s.flush()  # before counting: on SQLite, the write lock
                if quota is not None:
                    # this file's included, and what the tenant's responses in flight hold
                    total = committed_bytes(s, tenant_id=tenant_id, now=row.created_at)
                    if total > quota:
                        raise QuotaExceeded(total - size, size, quota)
                return FileRecord.of(row)
        except BaseException:
            self.blobs.remove(key)
            raise

    def get(self, tenant_id: str, file_id: str, now: datetime | None = None) -> FileRecord | None:
        with self.sessions() as s:
            row = s.scalar(_live(tenant_id, now or utcnow()).where(StoredFile.id == file_id))
            return None if row is None else FileRecord.of(row)

    def page(
        self,
        tenant_id: str,
        *,
        purpose: str | None,
        after: str | None,
        limit: int,
        order: Order,
    ) -> tuple[list[FileRecord], bool]:
        """One page of the tenant's live files by creation time (then id), after the file `after` (none
        once that file is gone, as OpenAI); whether more follow."""
        now = utcnow()
        with self.sessions() as s:
            query = _live(tenant_id, now)
            if purpose is not None:
                query = query.where(StoredFile.purpose == purpose)
            if after is not None:
                cursor = s.scalar(_live(tenant_id, now).where(StoredFile.id == after))
                if cursor is None:
                    return [], False
                query = query.where(
                    beyond(StoredFile.created_at, StoredFile.id, (cursor.created_at, cursor.id), order)
                )
            keys = (StoredFile.created_at, StoredFile.id)
            query = query.order_by(*(k.asc() if order == "asc" else k.desc() for k in keys))
            rows = list(s.scalars(query.limit(limit + 1)))
            return [FileRecord.of(row) for row in rows[:limit]], len(rows) > limit

    def content(self, record: FileRecord) -> Iterator[bytes]:
        """The file's bytes, CHUNK_BYTES at a time; opened now (a store that fails is an error before any
        byte is sent), read as iterated (blocking: Starlette iterates it in a thread)."""
        handle = self.blobs.open(record.blob)

        def chunks() -> Iterator[bytes]:
            with handle:
                while chunk := handle.read(CHUNK_BYTES):
                    yield chunk

        return chunks()

    def delete(self, tenant_id: str, file_id: str) -> bool:
        """Whether there was such a file. It expires now (it reads as missing and its bytes leave the quota
        at once), then its bytes and row go; if the store fails meanwhile, the sweep removes them later."""
        now = utcnow()
        with self.sessions() as s, s.begin():
            row = s.scalar(_live(tenant_id, now).where(StoredFile.id == file_id))
            if row is None:
                return False
            row.expires_at = now
            key = row.blob
        try:
            self._remove([(file_id, key)])
        except AdapterStoreUnavailable as error:
            log.warning("file %s deleted; its bytes are left to the sweep: %s", file_id, error)
        return True

    def stored_bytes(self, tenant_id: str, now: datetime | None = None) -> int:
        """What the tenant's live files take: counted with its stored responses against its quota."""
        with self.sessions() as s:
            return stored_file_bytes(s, tenant_id=tenant_id, now=now or utcnow())

    def sweep(self, now: datetime | None = None, batch: int = 100, max_batches: int = 20) -> int:
        """Remove expired files of every tenant, `batch` at a time, at most `max_batches` per call; returns
        how many. Bytes before rows: a row is never lost while its bytes remain."""
        now = now or utcnow()
        removed = 0
        for _ in range(max_batches):
            with self.sessions() as s:
                expired = select(StoredFile.id, StoredFile.blob).where(StoredFile.expires_at <= now)
                rows = [(row.id, row.blob) for row in s.execute(expired.limit(batch))]
            self._remove(rows)
            removed += len(rows)
            if len(rows) < batch:
                break
        return removed

    def _remove(self, rows: list[tuple[str, str]]) -> None:
        """Remove expired files: each one's bytes, then the rows."""
        for _, key in rows:
            self.blobs.remove(key)
        if rows:
            with self.sessions() as s, s.begin():
                s.execute(delete(StoredFile).where(StoredFile.id.in_([file_id for file_id, _ in rows])))


def _live(tenant_id: str, now: datetime) -> Select[StoredFile]:
    return select(StoredFile).where(StoredFile.tenant_id == tenant_id, StoredFile.expires_at > now)
