"""ResponseStore: stored responses in the platform database, always read and written by (tenant, id).

Another tenant's id, an expired response and a deleted one all read as missing, so a 404 tells nothing
about other tenants.

A continuation is stored by reference (issue 35): its row keeps its own input items and output and names
its predecessor (`context_from`) and how many leading items of the predecessor's chain it dropped
(`context_skip`, truncation); its chain is read by walking predecessors, one query per hop, at most
MAX_DEPTH hops (a continuation that deep stores its context flattened, and the walk starts again from it).
Storing one moves the expiry of every row its chain reads up to its own, so no link of a chain expires before
the chain; deleting a response that a live stored response still continues keeps its row as a link
(`deleted`: it reads as missing) until nothing continues it or it expires. So each item is stored once and
`size_bytes` is each row's own bytes: the quota counts what is held.

A request with store true holds the bytes it may store from its admission (`hold`, a storage_holds row
counted against the tenant's quota with its stored bytes, under the tenant's lock) until `save` turns the
hold into the row, or `release` drops it when the request ends otherwise; holds expire (HOLD_LIFE) so a
replica that died mid-request keeps none.

Expired rows and holds read as missing at once and are deleted by `sweep`, which every ingress
runs on a timer for all tenants (app/sweeper.py) in bounded batches; a disabled tenant's are
removed with it (billing.repository.disable_tenant). Sessions are synchronous: callers run these in the
thread pool.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import case, delete, select, update
from sqlalchemy.orm import Session

from app.settings import ResponsesConfig
from billing.models import StorageHold, StoredResponse, utcnow
from billing.repository import committed_bytes, lock_tenants, stored_response_bytes

MAX_DEPTH = 64  # hops a chain is read through: one query each
# A hold outlives any request: Serve's request_timeout_s (900 s in the cluster recipe) ends one before.
HOLD_LIFE = timedelta(minutes=30)


class _Full(Exception):
    def __init__(self, used: int) -> None:
        self.used = used


@dataclass(frozen=True)
class Stored:
    """A stored response, as read: what retrieval and continuation need."""

    id: str
    context: list[dict[str, Any]]
    input_items: list[dict[str, Any]]
    body: dict[str, Any]
    depth: int = 0  # hops from it to a row holding its context itself
    links: tuple[str, ...] = ()  # the rows its chain was read from, itself first (read with chain=True)

    def chain(self) -> list[dict[str, Any]]:
        """The conversation a continuation of this response starts from: its context, input and output."""
        return [*self.context, *self.input_items, *self.body.get("output", [])]


class ResponseStore:
    def __init__(self, sessions: Callable[[], Session], config: ResponsesConfig) -> None:
        self.sessions = sessions
        self.config = config

    def get(
        self, tenant_id: str, response_id: str, now: datetime | None = None, chain: bool = False
    ) -> Stored | None:
        """The response, or None when missing, expired or deleted. With `chain`, its context is read through
        its predecessors (what a continuation needs; None if a link is gone); without, it is the row's own
        (empty when stored by reference: retrieval and input_items do not read it)."""
        now = now or utcnow()
        with self.sessions() as s:
            row = s.scalar(_live(tenant_id, response_id, now).where(StoredResponse.deleted.is_(False)))
            if row is None:
                return None
            if not chain:
                return Stored(row.id, row.context, row.input_items, row.body, row.depth, (row.id,))
            rows = [row]
            while (previous := rows[-1].context_from) is not None:
                link = s.scalar(_live(tenant_id, previous, now)) if len(rows) <= MAX_DEPTH else None
                if link is None:
                    return None  # a link expired or went (not by this store's writes): nothing to continue
                rows.append(link)
            context: list[dict[str, Any]] = []
            for link in reversed(rows[1:]):
                context = [*context[link.context_skip :], *link.context, *link.input_items, *_output(link)]
            context = [*context[row.context_skip :], *row.context]
            return Stored(row.id, context, row.input_items, row.body, row.depth, tuple(r.id for r in rows))

    def save(
        self,
        tenant_id: str,
        body: dict[str, Any],
        context: list[dict[str, Any]],
        input_items: list[dict[str, Any]],
        previous: Stored | None = None,
    ) -> None:
        """Stores the response; `context` is the conversation before its input, a suffix of `previous`'s
        chain when it continues one (read with chain=True). Then the row refers to `previous` and keeps only
        its own items, unless the chain is MAX_DEPTH deep or `previous` went meanwhile: then it keeps its
        context itself."""
        now = utcnow()
        expires = now + timedelta(days=self.config.retention_days)
        with self.sessions() as s, s.begin():
            s.execute(delete(StorageHold).where(StorageHold.id == body["id"]))  # the row counts instead
            link = previous if previous is not None and context and previous.depth < MAX_DEPTH else None
            # Every link lives as long as this row; the predecessor's update also tells it is still there
            # (and, on PostgreSQL, holds it against a concurrent delete until this row is committed).
            if link is not None and _keep_until(s, tenant_id, [link.id], now, expires) == 1:
                _keep_until(s, tenant_id, list(link.links[1:]), now, expires)
            else:
                link = None
            own = [] if link is not None else context
            size = sum(len(json.dumps(v, separators=(",", ":"))) for v in (body, own, input_items))
            s.add(
                StoredResponse(
                    id=body["id"],
                    tenant_id=tenant_id,
                    model=body["model"],
                    previous_response_id=body.get("previous_response_id"),
                    context=own,
                    context_from=link.id if link is not None else None,
                    context_skip=len(link.chain()) - len(context) if link is not None else 0,
                    depth=link.depth + 1 if link is not None else 0,
                    deleted=False,
                    input_items=input_items,
                    body=body,
                    size_bytes=size,
                    created_at=now,
                    expires_at=expires,
                )
            )

    def hold(self, tenant_id: str, response_id: str, size: int, quota: int) -> int | None:
        """Hold `size` bytes for the response `response_id` while its request runs, if the tenant's stored
        and held bytes with them stay within `quota`: None when held, else what the tenant had committed
        before (nothing is held then). Counted in the hold's own transaction under the tenant's lock, so
        concurrent requests and uploads cannot pass the quota together."""
        now = utcnow()
        try:
            with self.sessions() as s, s.begin():
                lock_tenants(s, tenant_ids=[tenant_id])
                expires = now + HOLD_LIFE
                s.add(StorageHold(id=response_id, tenant_id=tenant_id, bytes=size, expires_at=expires))
                s.flush()  # before counting: on SQLite, the write lock
                total = committed_bytes(s, tenant_id=tenant_id, now=now)  # this hold's included
                if total > quota:
                    raise _Full(total - size)  # rolls the hold back
        except _Full as full:
            return full.used
        return None

    def release(self, response_id: str) -> None:
        """Drop the hold of a request that ended without storing its response (idempotent)."""
        with self.sessions() as s, s.begin():
            s.execute(delete(StorageHold).where(StorageHold.id == response_id))

    def stored_bytes(self, tenant_id: str, now: datetime | None = None) -> int:
        """What the tenant's live stored responses take (their size_bytes): what its quota is read against."""
        with self.sessions() as s:
            return stored_response_bytes(s, tenant_id=tenant_id, now=now or utcnow())

    def delete(self, tenant_id: str, response_id: str) -> bool:
        """Whether there was such a response (expired and deleted ones are gone already). One that a live
        stored response continues is kept as a link of its chain, marked deleted; one nothing continues is
        removed, and so is each deleted link up its chain that nothing else continues."""
        now = utcnow()
        with self.sessions() as s, s.begin():
            marked = s.execute(
                update(StoredResponse)
                .where(
                    StoredResponse.id == response_id,
                    StoredResponse.tenant_id == tenant_id,
                    StoredResponse.expires_at > now,
                    StoredResponse.deleted.is_(False),
                )
                .values(deleted=True)
            )
            if not getattr(marked, "rowcount", 0):
                return False
            current: str | None = response_id
            for _ in range(MAX_DEPTH + 1):
                row = s.scalar(
                    select(StoredResponse).where(
                        StoredResponse.id == current,
                        StoredResponse.tenant_id == tenant_id,
                        StoredResponse.deleted.is_(True),
                    )
                )
                continued = select(StoredResponse.id).where(
                    StoredResponse.context_from == current,
                    StoredResponse.tenant_id == tenant_id,
                    StoredResponse.expires_at > now,
                )
                if row is None or s.scalar(continued.limit(1)) is not None:
                    break
                current = row.context_from
                s.delete(row)
                s.flush()
                if current is None:
                    break
            return True

    def sweep(self, now: datetime | None = None, batch: int = 500, max_batches: int = 20) -> int:
        """Delete expired rows of every tenant, `batch` at a time (one short transaction each, so no long lock
        and no huge statement), at most `max_batches` per call (the next call goes on); returns how many."""
        now = now or utcnow()
        deleted = 0
        for _ in range(max_batches):
            with self.sessions() as s, s.begin():
                ids = list(
                    s.scalars(select(StoredResponse.id).where(StoredResponse.expires_at <= now).limit(batch))
                )
                if ids:
                    s.execute(
                        delete(StoredResponse).where(
                            StoredResponse.id.in_(ids), StoredResponse.expires_at <= now
                        )
                    )
            deleted += len(ids)
            if len(ids) < batch:
                break
        with self.sessions() as s, s.begin():  # holds left by replicas that died mid-request
            s.execute(delete(StorageHold).where(StorageHold.expires_at <= now))
        return deleted


def _live(tenant_id: str, response_id: str, now: datetime) -> Any:
    return select(StoredResponse).where(
        StoredResponse.id == response_id,
        StoredResponse.tenant_id == tenant_id,
        StoredResponse.expires_at > now,
    )


def _output(row: StoredResponse) -> list[dict[str, Any]]:
    return list(row.body.get("output", []))


def _keep_until(s: Session, tenant_id: str, ids: list[str], now: datetime, expires: datetime) -> int:
    """Moves the live rows' expiry up to `expires` (never down); how many rows there were."""
    if not ids:
        return 0
    result = s.execute(
        update(StoredResponse)
        .where(
            StoredResponse.id.in_(ids), StoredResponse.tenant_id == tenant_id, StoredResponse.expires_at > now
        )
        .values(
            expires_at=case((StoredResponse.expires_at < expires, expires), else_=StoredResponse.expires_at)
        )
    )
    return int(getattr(result, "rowcount", 0) or 0)
