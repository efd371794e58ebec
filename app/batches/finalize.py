"""Finisher: batches whose lines have all ended (or that were cancelled, or whose window passed) get their
output and error files and their final status.

`ready` finds them: `in_progress` with no line queued or running; `cancelling` with no line running under a
live lease (a cancel drops queued lines; one given back since is dropped when it ends); `in_progress` past
`expires_at` likewise (its lines left over become `batch_expired` lines of the error file, as OpenAI's);
and `finalizing` (or `cancelling`) ones whose finalizer started more than a lease ago and never ended (its
replica died). `finalize` takes one with a conditional UPDATE (one replica wins), writes the files a line
at a time from the database (never the whole batch in memory) and ends it with counts recounted from its
lines. Blocking: run in a thread.
"""

import json
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import IO, Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from app.batches.leases import changed
from app.batches.store import drop_queued
from app.services import Services
from billing.models import Batch, BatchLine, utcnow

log = logging.getLogger(__name__)
EXPIRED = {
    "code": "batch_expired",
    "message": "This request could not be executed before the completion window expired.",
}
READ_ROWS = 500  # lines read per query while writing the files


def line_id(request_id: str) -> str:
    """The `id` of a line of the output or error file: the line's request id, batch_req_-prefixed."""
    return "batch_req_" + request_id.removeprefix("req_")


def file_line(custom_id: str, request_id: str, response: dict[str, Any] | None, error: Any) -> bytes:
    """A line of an output or error file in OpenAI's shape; `response`: {"status_code", "body"}."""
    answer = None if response is None else {**response, "request_id": request_id}
    value = {"id": line_id(request_id), "custom_id": custom_id, "response": answer, "error": error}
    return json.dumps(value, separators=(",", ":")).encode() + b"\n"


@dataclass
class Written:
    path: Path
    lines: int = 0
    size: int = 0

    def add(self, handle: IO[bytes], data: bytes) -> None:
        handle.write(data)
        self.lines += 1
        self.size += len(data)


class Finisher:
    def __init__(self, services: Services) -> None:
        self.services = services
        self.sessions = services.session_factory
        self.config = services.settings.batches

    def ready(self) -> list[str]:
        now = utcnow()
        stale = now - timedelta(seconds=self.config.lease_s)
        unclaimed = or_(Batch.finalizing_at.is_(None), Batch.finalizing_at < stale)
        with self.sessions() as s:
            batches = list(
                s.execute(
                    select(Batch.id, Batch.status, Batch.expires_at).where(
                        or_(
                            and_(Batch.status.in_(("in_progress", "cancelling")), unclaimed),
                            and_(Batch.status == "finalizing", Batch.finalizing_at < stale),
                        )
                    )
                ).tuples()
            )
            return [
                batch_id
                for batch_id, status, expires_at in batches
                if status == "finalizing" or self._ended(s, batch_id, status, expires_at, now)
            ]

    @staticmethod
    def _ended(s: Session, batch_id: str, status: str, expires_at: datetime, now: datetime) -> bool:
        live = and_(BatchLine.state == "running", BatchLine.lease_expires_at >= now)
        waiting = BatchLine.state.in_(("queued", "running"))
        stopping = status == "cancelling" or expires_at <= now
        pending = live if stopping else waiting
        left = s.scalar(select(BatchLine.line).where(BatchLine.batch_id == batch_id, pending).limit(1))
        return left is None

    def finalize(self, batch_id: str) -> str | None:
        """The batch's final status, or None when another replica finalizes it."""
        now = utcnow()
        stale = now - timedelta(seconds=self.config.lease_s)
        with self.sessions() as s, s.begin():
            batch = s.scalar(select(Batch).where(Batch.id == batch_id).with_for_update())
            if batch is None or batch.status not in ("in_progress", "cancelling", "finalizing"):
                return None
            if batch.finalizing_at is not None and batch.finalizing_at >= stale:  # another replica's, live
                return None
            cancelled = batch.status == "cancelling"
            taken = changed(
                s,
                update(Batch)
                .where(Batch.id == batch_id, Batch.status == batch.status)
                .values(finalizing_at=now, status="cancelling" if cancelled else "finalizing")
                .execution_options(synchronize_session=False),
            )
            tenant_id = batch.tenant_id
        if not taken:
            return None
        with self.sessions() as s:
            left = s.scalar(
                select(func.count())
                .select_from(BatchLine)
                .where(BatchLine.batch_id == batch_id, BatchLine.state.in_(("queued", "running")))
            )
        final = "cancelled" if cancelled else "expired" if left else "completed"
        output, errors = self._write(tenant_id, batch_id, expired=final == "expired")
        with self.sessions() as s, s.begin():
            if final == "cancelled":  # a line given back for a retry after the cancel never runs
                drop_queued(s, batch_id)
            s.execute(
                update(Batch)
                .where(Batch.id == batch_id)
                .values(
                    status=final,
                    output_file_id=output,
                    error_file_id=errors,
                    completed=self._count(s, batch_id, "done"),
                    failed=self._count(s, batch_id, "failed") + (int(left or 0) if final == "expired" else 0),
                    **{f"{final}_at": utcnow()},
                )
            )
        log.info("batch %s %s", batch_id, final)
        return final

    @staticmethod
    def _count(s: Session, batch_id: str, state: str) -> int:
        query = select(func.count()).select_from(BatchLine)
        return int(s.scalar(query.where(BatchLine.batch_id == batch_id, BatchLine.state == state)) or 0)

    def _rows(self, batch_id: str) -> Iterator[BatchLine]:
        after = 0
        while True:
            with self.sessions() as s:
                rows = list(
                    s.scalars(
                        select(BatchLine)
                        .where(BatchLine.batch_id == batch_id, BatchLine.line > after)
                        .order_by(BatchLine.line)
                        .limit(READ_ROWS)
                    )
                )
            if not rows:
                return
            yield from rows
            after = rows[-1].line

    def _write(self, tenant_id: str, batch_id: str, *, expired: bool) -> tuple[str | None, str | None]:
        """The output and error files' ids (None: no such line)."""
        with tempfile.TemporaryDirectory(dir=self.services.settings.data_dir) as scratch:
            output, errors = Written(Path(scratch) / "output.jsonl"), Written(Path(scratch) / "errors.jsonl")
            with output.path.open("wb") as out, errors.path.open("wb") as err:
                for row in self._rows(batch_id):
                    if row.state == "done":
                        output.add(out, file_line(row.custom_id, row.request_id, row.response, None))
                    elif row.state == "failed":
                        errors.add(err, file_line(row.custom_id, row.request_id, row.response, row.error))
                    elif expired:  # never ran, or its runner was still at it when the window closed
                        errors.add(err, file_line(row.custom_id, row.request_id, None, EXPIRED))
            return (
                self._store(tenant_id, batch_id, output, "output"),
                self._store(tenant_id, batch_id, errors, "error"),
            )

    def _store(self, tenant_id: str, batch_id: str, written: Written, kind: str) -> str | None:
        if not written.lines:
            return None
        retention = timedelta(days=self.services.settings.files.output_retention_days)
        record = self.services.file_store().create(
            tenant_id,
            purpose="batch_output",
            filename=f"{batch_id}_{kind}.jsonl",
            source=written.path,
            size=written.size,
            lines=written.lines,
            expires_at=utcnow() + retention,
        )
        return record.id
