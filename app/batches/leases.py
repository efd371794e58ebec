"""LineLeases: batch lines claimed, renewed and ended by a runner (app/batches/runner.py) through the
database, so any number of ingress replicas share the work and a replica that dies loses no line.

A claim is one conditional UPDATE per batch (`queued`, or `running` with a lapsed lease, becomes `running`
under this runner's lease), then a read of what this runner got: two replicas racing for the same lines
each get only what their UPDATE changed. Only batches `in_progress` and not past their window are claimed
from; the batch row is locked meanwhile (FOR UPDATE on PostgreSQL, as BatchStore.cancel does), so no line
starts in a batch being cancelled. A tenant's running lines, on every replica and across its batches, stay
within `max_in_flight_per_tenant` (its tenant row is locked while a claim counts them). Lines of one model
are claimed together (adapter loads shared), and within it by the opening of their prompts (prefixes
prefilled once). A line whose runner stopped `max_lost` times fails rather than runs again. A line ends
(`done`, `failed`, or back to `queued` for another try, not before a wait its lease_expires_at holds) only
while its lease is this runner's: one that lapsed and was claimed again is the new owner's, and ends once.
Blocking: run in a thread.
"""

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, case, func, or_, select, update
from sqlalchemy.orm import Session

from app.settings import BatchesConfig
from billing.models import Batch, BatchLine, utcnow
from billing.repository import lock_tenants

# Lines of one model together (adapter loads shared), within it those whose prompts open alike.
CLAIM_ORDER = (BatchLine.model, BatchLine.prefix, BatchLine.line)
LOST = {
    "code": "batch_line_lost",
    "message": "This request's runner stopped before it finished, too many times; it was not retried again.",
}


def changed(s: Session, statement: Any) -> int:
    """Rows an UPDATE changed."""
    return int(getattr(s.execute(statement), "rowcount", 0) or 0)


@dataclass(frozen=True)
class Claimed:
    """A line this runner now holds, with what running it needs."""

    batch_id: str
    line: int
    custom_id: str
    request_id: str
    body: dict[str, Any]
    attempts: int
    tenant_id: str
    key_id: str
    endpoint: str


def _lapsed(now: datetime) -> ColumnElement[bool]:
    return and_(BatchLine.state == "running", BatchLine.lease_expires_at < now)


def _ready(now: datetime) -> ColumnElement[bool]:
    """Queued and not waiting to be retried (a queued line's lease_expires_at is when it may run again,
    or null)."""
    waited = or_(BatchLine.lease_expires_at.is_(None), BatchLine.lease_expires_at <= now)
    return and_(BatchLine.state == "queued", waited)


def _claimable(now: datetime) -> ColumnElement[bool]:
    """Ready to run, or running under a lease that lapsed."""
    return or_(_ready(now), _lapsed(now))


class LineLeases:
    def __init__(self, sessions: Callable[[], Session], config: BatchesConfig) -> None:
        self.sessions = sessions
        self.config = config

    def _lease(self, now: datetime) -> datetime:
        return now + timedelta(seconds=self.config.lease_s)

    def claim(self, owner: str, room: int) -> list[Claimed]:
        """Up to `room` lines for `owner`, oldest batches first."""
        now = utcnow()
        claimed: list[Claimed] = []
        with self.sessions() as s, s.begin():
            batches = list(
                s.scalars(
                    select(Batch)
                    .where(Batch.status == "in_progress", Batch.expires_at > now)
                    .order_by(Batch.created_at, Batch.id)
                )
            )
            # Claims of one tenant's lines, on every replica, one at a time, its running lines counted only
            # then (when any other runner's claim has committed): its row locked before any other row, and on
            # SQLite a write (failing the lines of exhausted leases) before the count. Each batch's own lock
            # guards its cancel.
            lock_tenants(s, tenant_ids=[batch.tenant_id for batch in batches])
            if batches:
                self._fail_exhausted(s, [batch.id for batch in batches], now)
            running = self._running_by_tenant(s, now)
            for batch in batches:
                free = min(
                    room - len(claimed),
                    self.config.max_in_flight_per_tenant - running.get(batch.tenant_id, 0),
                )
                if len(claimed) >= room:
                    break
                if free <= 0:
                    continue
                status = s.scalar(select(Batch.status).where(Batch.id == batch.id).with_for_update())
                if status != "in_progress":
                    continue
                got = self._claim_lines(s, batch, owner, free, now)
                running[batch.tenant_id] = running.get(batch.tenant_id, 0) + len(got)
                claimed.extend(got)
        return claimed

    def _running_by_tenant(self, s: Session, now: datetime) -> dict[str, int]:
        rows = s.execute(
            select(Batch.tenant_id, func.count())
            .join(BatchLine, BatchLine.batch_id == Batch.id)
            .where(Batch.status.in_(("in_progress", "cancelling")))
            .where(BatchLine.state == "running", BatchLine.lease_expires_at >= now)
            .group_by(Batch.tenant_id)
        )
        return {tenant: int(count) for tenant, count in rows.tuples()}

    def queued_by_tenant(self) -> dict[str, int]:
        """Lines of batches in progress waiting for a runner (queued, a retry's wait included, or their
        lease lapsed), per tenant: what the batch metrics show as queued."""
        now = utcnow()
        with self.sessions() as s:
            rows = s.execute(
                select(Batch.tenant_id, func.count())
                .join(BatchLine, BatchLine.batch_id == Batch.id)
                .where(Batch.status == "in_progress", or_(BatchLine.state == "queued", _lapsed(now)))
                .group_by(Batch.tenant_id)
            )
            return {tenant: int(count) for tenant, count in rows.tuples()}

    def _fail_exhausted(self, s: Session, batch_ids: list[str], now: datetime) -> None:
        """A line whose lease lapsed (its runner stopped) fails rather than runs again when that was its
        `max_lost`-th loss or its `max_attempts`-th claim: a line that takes down its replica does not do
        so forever, nor as often as the platform's own failures may be retried. One statement for every
        batch in progress (it was one per batch, per claim), then a count per batch that had such lines."""
        ended = s.scalars(
            update(BatchLine)
            .where(
                BatchLine.batch_id.in_(batch_ids),
                BatchLine.state == "running",
                BatchLine.lease_expires_at < now,
            )
            .where(
                or_(
                    BatchLine.attempts >= self.config.max_attempts,
                    BatchLine.lost + 1 >= self.config.max_lost,
                )
            )
            .values(state="failed", error=LOST, lost=BatchLine.lost + 1, finished_at=now)
            .values(lease_owner=None, lease_expires_at=None)
            .returning(BatchLine.batch_id)
            .execution_options(synchronize_session=False)
        ).all()
        for batch_id, count in Counter(ended).items():
            s.execute(update(Batch).where(Batch.id == batch_id).values(failed=Batch.failed + count))

    def _claim_lines(self, s: Session, batch: Batch, owner: str, free: int, now: datetime) -> list[Claimed]:
        # Lines whose runner stopped first (few), then queued ones ready to run, read in claim order off
        # ix_batch_lines_claim: one query over both states would sort every queued line of the batch.
        wanted = list(
            s.scalars(
                select(BatchLine.line)
                .where(BatchLine.batch_id == batch.id, _lapsed(now))
                .order_by(*CLAIM_ORDER)
                .limit(free)
            )
        )
        if len(wanted) < free:
            wanted += s.scalars(
                select(BatchLine.line)
                .where(BatchLine.batch_id == batch.id, _ready(now))
                .order_by(*CLAIM_ORDER)
                .limit(free - len(wanted))
            )
        if not wanted:
            return []
        s.execute(
            update(BatchLine)
            .where(BatchLine.batch_id == batch.id, BatchLine.line.in_(wanted), _claimable(now))
            .values(
                state="running",
                lease_owner=owner,
                lease_expires_at=self._lease(now),
                attempts=BatchLine.attempts + 1,
                lost=BatchLine.lost + case((BatchLine.state == "running", 1), else_=0),  # its lease lapsed
            )
            .execution_options(synchronize_session=False)
        )
        rows = s.execute(
            select(
                BatchLine.line, BatchLine.custom_id, BatchLine.request_id, BatchLine.body, BatchLine.attempts
            )
            .where(BatchLine.batch_id == batch.id, BatchLine.line.in_(wanted))
            .where(BatchLine.state == "running", BatchLine.lease_owner == owner)
            .order_by(*CLAIM_ORDER)
        )
        return [
            Claimed(
                batch.id,
                line,
                custom_id,
                request_id,
                body,
                attempts,
                batch.tenant_id,
                batch.key_id,
                batch.endpoint,
            )
            for line, custom_id, request_id, body, attempts in rows.tuples()
        ]

    def renew(self, owner: str, lines: list[Claimed]) -> int:
        """Push back the leases of `lines` (those `owner` still runs: a line whose task ended without
        ending it is left to lapse, not held forever); how many it still holds."""
        now = utcnow()
        by_batch: dict[str, list[int]] = {}
        for line in lines:
            by_batch.setdefault(line.batch_id, []).append(line.line)
        held = 0
        with self.sessions() as s, s.begin():
            for batch_id, numbers in by_batch.items():
                held += changed(
                    s,
                    update(BatchLine)
                    .where(BatchLine.batch_id == batch_id, BatchLine.line.in_(numbers))
                    .where(BatchLine.lease_owner == owner, BatchLine.state == "running")
                    .values(lease_expires_at=self._lease(now))
                    .execution_options(synchronize_session=False),
                )
        return held

    def finish(
        self,
        owner: str,
        line: Claimed,
        *,
        ok: bool,
        response: dict[str, Any] | None,
        error: dict[str, Any] | None,
    ) -> bool:
        """End a line `done` (ok) or `failed` with what its output or error file line says, counted in its
        batch, if it is still `owner`'s; whether it was."""
        now = utcnow()
        with self.sessions() as s, s.begin():
            ended = changed(
                s,
                self._own(owner, line)
                .values(
                    state="done" if ok else "failed",
                    response=response,
                    error=error,
                    finished_at=now,
                    lease_owner=None,
                    lease_expires_at=None,
                )
                .execution_options(synchronize_session=False),
            )
            if ended:
                counter = {"completed": Batch.completed + 1} if ok else {"failed": Batch.failed + 1}
                s.execute(update(Batch).where(Batch.id == line.batch_id).values(**counter))
            return bool(ended)

    def requeue(self, owner: str, line: Claimed, wait_s: float) -> bool:
        """Give a line back for another try (the platform failed it, not its body), not before `wait_s`."""
        again = utcnow() + timedelta(seconds=wait_s)
        with self.sessions() as s, s.begin():
            back = self._own(owner, line).values(state="queued", lease_owner=None, lease_expires_at=again)
            return bool(changed(s, back.execution_options(synchronize_session=False)))

    @staticmethod
    def _own(owner: str, line: Claimed) -> Any:
        return update(BatchLine).where(
            BatchLine.batch_id == line.batch_id,
            BatchLine.line == line.line,
            BatchLine.state == "running",
            BatchLine.lease_owner == owner,
        )
