"""The outbox survives a killed ingress replica: records it wrote (and even claimed) before it died are
delivered by another replica, in another process, exactly once, once the dead one's claim lapses."""

import asyncio
import multiprocessing
import os
import sqlite3
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.metering.database_sink import DatabaseSink
from app.metering.delivery import UsageDelivery
from app.metering.outbox import Outbox
from billing.db import make_engine, make_session_factory
from billing.migrate import upgrade
from billing.models import UsageEvent
from billing.usage import UsageRecord

LEASE_S = 1.0


def record(request_id: str) -> UsageRecord:
    now = datetime.now(UTC)
    return UsageRecord(
        request_id=request_id, tenant_id="t", key_id="k", model="m", base_model="m", adapter_id=None,
        adapter_version=None, status="completed", finish_reason="stop", prompt_tokens=3, cached_tokens=0,
        completion_tokens=2, gpu_ms=1.0, queue_ms=0.0, ttft_ms=1.0, latency_ms=2.0, replica="r",
        started_at=now, finished_at=now,
    )  # fmt: skip


def write_claim_and_die(path: str, ids: list[str], ready: "multiprocessing.synchronize.Event") -> None:
    """An ingress replica that wrote its records, claimed them for delivery, and was killed before it
    could deliver any (no cleanup, no atexit: os._exit)."""
    outbox = Outbox(Path(path))
    for request_id in ids:
        outbox.add(record(request_id))
    assert len(outbox.claim("doomed-replica", limit=len(ids), lease_s=LEASE_S)) == len(ids)
    ready.set()
    time.sleep(60)  # killed here
    os._exit(0)


def deliver_until_empty(path: str, database_url: str, delivered: "multiprocessing.queues.Queue[int]") -> None:
    """Another replica's delivery loop: rounds until the outbox is empty; reports how many it moved."""

    async def run() -> int:
        outbox = Outbox(Path(path))
        sink = DatabaseSink(make_session_factory(make_engine(database_url)))
        delivery = UsageDelivery(outbox, sink, batch=7, claim_lease_s=30.0)
        moved, deadline = 0, time.monotonic() + 30
        while outbox.pending() and time.monotonic() < deadline:
            moved += await delivery.deliver_once()
            await asyncio.sleep(0.05)
        return moved

    delivered.put(asyncio.run(run()))


def count(sessions: "sessionmaker[Session]", ids: list[str]) -> int:
    with sessions() as session:
        return int(session.scalar(select(func.count()).where(UsageEvent.request_id.in_(ids))) or 0)


def test_a_killed_replicas_records_are_delivered_once_by_others(tmp_path: Path, sqlite_url: str) -> None:
    upgrade(sqlite_url)
    sessions = make_session_factory(make_engine(sqlite_url))
    path = str(tmp_path / "outbox.sqlite")
    ids = [f"req_{uuid.uuid4().hex}" for _ in range(40)]
    spawn = multiprocessing.get_context("spawn")
    ready = spawn.Event()
    doomed = spawn.Process(target=write_claim_and_die, args=(path, ids, ready))
    doomed.start()
    assert ready.wait(60), "the first replica never wrote its records"
    doomed.kill()  # SIGKILL: after writing and claiming, before any delivery
    doomed.join()
    killed_at = time.monotonic()
    assert count(sessions, ids) == 0 and Outbox(Path(path)).pending() == 40

    # Two other replicas compete for the orphaned rows once the dead one's claim lapses.
    delivered = spawn.Queue()
    others = [spawn.Process(target=deliver_until_empty, args=(path, sqlite_url, delivered)) for _ in range(2)]
    for process in others:
        process.start()
    for process in others:
        process.join(60)
        assert process.exitcode == 0
    moved = [delivered.get(timeout=5), delivered.get(timeout=5)]
    assert sum(moved) == 40  # each record moved by exactly one of them
    assert count(sessions, ids) == 40 and Outbox(Path(path)).pending() == 0
    assert time.monotonic() - killed_at >= LEASE_S * 0.9  # nobody took them while the claim still held


def test_a_claim_blocks_others_until_it_lapses(tmp_path: Path) -> None:
    first, second = Outbox(tmp_path / "o.sqlite"), Outbox(tmp_path / "o.sqlite")  # two replicas, one file
    first.add(record("a"))
    first.add(record("b"))
    assert [r.request_id for _, r in first.claim("one", limit=10, lease_s=0.5)] == ["a", "b"]
    assert second.claim("two", limit=10, lease_s=0.5) == []  # held
    time.sleep(0.6)
    taken = second.claim("two", limit=10, lease_s=30)
    assert [r.request_id for _, r in taken] == ["a", "b"]  # lapsed: the second replica takes over
    assert first.claim("one", limit=10) == []
    second.done([i for i, _ in taken])
    assert first.pending() == 0
    second.release([])  # releasing nothing is harmless


def test_the_loops_write_never_waits_it_leaves_the_record_to_a_thread(tmp_path: Path) -> None:
    """try_add writes on the caller's thread only when no lock is held; otherwise it writes nothing (the
    caller then adds in a thread), and nothing is lost either way."""
    path = tmp_path / "outbox.sqlite"
    outbox = Outbox(path)
    assert outbox.try_add(record("inline")) and outbox.pending() == 1
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another replica's claim holds SQLite's write lock
    started = time.monotonic()
    assert not outbox.try_add(record("busy"))
    assert time.monotonic() - started < 0.5  # refused at once, not after the 10 s busy timeout
    other.execute("COMMIT")
    other.close()
    with outbox._lock:  # this process's delivery thread holds the outbox
        assert not outbox.try_add(record("held"))
    outbox.add(record("busy"))
    assert outbox.try_add(record("inline")) and outbox.pending() == 2  # a retried id is ignored
    assert {r.request_id for _, r in outbox.claim("me", 10)} == {"inline", "busy"}
    outbox.close()
