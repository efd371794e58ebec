"""BatchStore: batches and their lines in the platform database (billing/models/batch.py, batch_line.py),
always read by (tenant, id): another tenant's batch reads as missing.

A batch that passed validation is written with all its lines in one transaction (`create_running`): the
runner sees it whole or not at all. Cancelling a batch drops its queued lines at once (never run, never
billed; its input file still holds them): one none of whose lines has left the queue is `cancelled` then;
otherwise it is `cancelling`, and the runner lets its running lines end and finishes it. The batch row is
locked while cancelling (FOR UPDATE on PostgreSQL), so a runner that locks it too while claiming lines
cannot start a line of a batch being cancelled. Sessions are synchronous: callers run these in the thread
pool.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import IO, Any

from sqlalchemy import Select, delete, func, insert, select
from sqlalchemy.orm import Session

from app.batches.lines import LineError, line_request_id, prompt_prefix
from app.batches.objects import batch_object
from app.batches.validation import numbered_lines
from app.cursor_page import beyond
from app.errors import Conflict
from billing.models import ACTIVE_BATCH_STATUSES, Batch, BatchLine, new_id, utcnow

WINDOWS = {"24h": timedelta(hours=24)}
INSERT_ROWS = 1000  # lines written per INSERT statement
CANCELLABLE = ("validating", "in_progress")


@dataclass(frozen=True)
class NewBatch:
    tenant_id: str
    key_id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict[str, str] | None


class BatchStore:
    def __init__(self, sessions: Callable[[], Session]) -> None:
        self.sessions = sessions

    def active(self, tenant_id: str) -> int:
        """The tenant's batches that are not finished (ACTIVE_BATCH_STATUSES)."""
        with self.sessions() as s:
            count = s.scalar(
                select(func.count())
                .select_from(Batch)
                .where(Batch.tenant_id == tenant_id, Batch.status.in_(ACTIVE_BATCH_STATUSES))
            )
            return int(count or 0)

    def create_failed(self, new: NewBatch, errors: list[LineError]) -> dict[str, Any]:
        """A batch whose file failed validation: `failed`, with its line errors; no line is stored."""
        now = utcnow()
        row = _row(new, "failed", now)
        row.errors = [error.to_api() for error in errors]
        row.failed_at = now
        with self.sessions() as s, s.begin():
            s.add(row)
        return batch_object(row)

    def create_running(self, new: NewBatch, handle: IO[bytes], total: int) -> dict[str, Any]:
        """A batch whose file passed validation, `in_progress`, with a queued row per line read from `handle`
        (the same file, read again: only INSERT_ROWS lines are held at once), all in one transaction."""
        now = utcnow()
        row = _row(new, "in_progress", now)
        row.total = total
        row.in_progress_at = now
        with self.sessions() as s, s.begin():
            s.add(row)
            s.flush()
            # Core, not the ORM's bulk insert: a third of the time for 50,000 rows.
            connection, lines = s.connection(), insert(BatchLine)  # run by the connection: Core
            chunk: list[dict[str, Any]] = []
            for number, raw in numbered_lines(handle):
                value = json.loads(raw)
                body = value["body"]
                chunk.append(
                    {
                        "batch_id": row.id,
                        "line": number,
                        "custom_id": value["custom_id"],
                        "request_id": line_request_id(row.id, value["custom_id"]),
                        "model": body["model"],
                        "prefix": prompt_prefix(body),
                        "body": body,
                        "state": "queued",
                        "attempts": 0,
                        "lost": 0,
                    }
                )
                if len(chunk) >= INSERT_ROWS:
                    connection.execute(lines, chunk)
                    chunk = []
            if chunk:
                connection.execute(lines, chunk)
        return batch_object(row)

    def get(self, tenant_id: str, batch_id: str) -> dict[str, Any] | None:
        with self.sessions() as s:
            row = s.scalar(_own(tenant_id, batch_id))
            return None if row is None else batch_object(row)

    def page(self, tenant_id: str, *, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """One page of the tenant's batches, newest first, after the batch `after`; whether more follow."""
        with self.sessions() as s:
            query = select(Batch).where(Batch.tenant_id == tenant_id)
            if after is not None:
                cursor = s.scalar(_own(tenant_id, after))
                if cursor is None:
                    return [], False
                query = query.where(
                    beyond(Batch.created_at, Batch.id, (cursor.created_at, cursor.id), "desc")
                )
            rows = list(s.scalars(query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1)))
            return [batch_object(row) for row in rows[:limit]], len(rows) > limit

    def every_tenant(self, tenant_id: str | None, *, limit: int) -> list[dict[str, Any]]:
        """The newest batches of every tenant (or of `tenant_id`), each with its tenant: for operators."""
        with self.sessions() as s:
            query = select(Batch)
            if tenant_id is not None:
                query = query.where(Batch.tenant_id == tenant_id)
            rows = s.scalars(query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit))
            return [{**batch_object(row), "tenant_id": row.tenant_id} for row in rows]

    def tenant_of(self, batch_id: str) -> str | None:
        with self.sessions() as s:
            return s.scalar(select(Batch.tenant_id).where(Batch.id == batch_id))

    def cancel(self, tenant_id: str, batch_id: str) -> dict[str, Any] | None:
        """The batch after cancelling it, or None when the tenant has no such batch; Conflict when it has
        finished. Cancelling twice changes nothing."""
        now = utcnow()
        with self.sessions() as s, s.begin():
            row = s.scalar(_own(tenant_id, batch_id).with_for_update())
            if row is None:
                return None
            if row.status in ("cancelling", "cancelled"):
                return batch_object(row)
            if row.status not in CANCELLABLE:
                raise Conflict(
                    f"Batch {batch_id} is {row.status}: only a batch not yet finishing can be cancelled."
                )
            started = s.scalar(
                select(BatchLine.line)
                .where(BatchLine.batch_id == batch_id, BatchLine.state != "queued")
                .limit(1)
            )
            row.cancelling_at = now
            drop_queued(s, batch_id)
            if started is None:  # nothing ran: nothing to finish or deliver
                row.status, row.cancelled_at = "cancelled", now
            else:  # the runner lets running lines end, writes what ran, then marks it cancelled
                row.status = "cancelling"
            return batch_object(row)


def drop_queued(s: Session, batch_id: str) -> None:
    """Delete a cancelled batch's lines that have not started: never run, never billed."""
    s.execute(delete(BatchLine).where(BatchLine.batch_id == batch_id, BatchLine.state == "queued"))


def _own(tenant_id: str, batch_id: str) -> Select[Batch]:
    return select(Batch).where(Batch.id == batch_id, Batch.tenant_id == tenant_id)


def _row(new: NewBatch, status: str, now: datetime) -> Batch:
    return Batch(
        id=new_id("batch"),
        tenant_id=new.tenant_id,
        key_id=new.key_id,
        endpoint=new.endpoint,
        input_file_id=new.input_file_id,
        completion_window=new.completion_window,
        status=status,
        metadata_=new.metadata,
        errors=None,
        total=0,
        completed=0,
        failed=0,
        created_at=now,
        expires_at=now + WINDOWS[new.completion_window],
    )
