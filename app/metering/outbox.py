"""Outbox: usage records kept on local disk until the billing database has them.

An ingress replica writes each record here before trying to deliver it, so a Metering deployment or a
database that is down loses nothing: delivery retries until it succeeds, and the database ignores ids it
already has, so a retried batch is never counted twice. One SQLite file per node is shared by every ingress
replica there: a replica claims rows for a while, and rows claimed by a replica that died are claimed again
once the claim lapses.

`try_add` writes a record on the caller's thread (the event loop: ~0.1 ms, a third of a hop to the thread
pool) when it can do so without waiting: nobody in this process holds the outbox and SQLite's write lock is
free (another replica's claim holds it for a moment). Otherwise it writes nothing and the caller uses `add`
in a thread. Its connection never checkpoints (the delivery connection does, off the loop), so the loop
never waits on an fsync.
"""

import json
import sqlite3
import threading
import time
from dataclasses import fields
from datetime import datetime
from pathlib import Path
from typing import Any

from app.private_files import create_private_file
from billing.usage import UsageRecord

_DATETIME_FIELDS = {"started_at", "finished_at"}
_FIELDS = tuple(f.name for f in fields(UsageRecord))
_INSERT = "INSERT OR IGNORE INTO outbox (request_id, body) VALUES (?, ?)"


def _encode(record: UsageRecord) -> str:
    # Its fields are flat scalars: read them, not `asdict`, which deep-copies each (~0.2 ms a request).
    data = {name: getattr(record, name) for name in _FIELDS}
    for name in _DATETIME_FIELDS:
        data[name] = data[name].isoformat()
    return json.dumps(data)


def _decode(text: str) -> UsageRecord:
    data: dict[str, Any] = json.loads(text)
    for name in _DATETIME_FIELDS:
        data[name] = datetime.fromisoformat(data[name])
    return UsageRecord(**{k: v for k, v in data.items() if k in _FIELDS})


class Outbox:
    def __init__(self, path: Path) -> None:
        create_private_file(path)  # 0600 before SQLite opens it (its -wal/-shm files copy the mode)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=10, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        # WAL with synchronous=NORMAL: a committed record survives the replica's crash (what the outbox is
        # for: another replica of the node delivers it); only a power loss of the node can take its last
        # records before a checkpoint. FULL fsyncs every insert: ~1 ms on each request's path.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS outbox (id INTEGER PRIMARY KEY AUTOINCREMENT, "
            "request_id TEXT UNIQUE, body TEXT NOT NULL, claimed_by TEXT, claimed_until REAL)"
        )
        # The event loop's connection: never waits for SQLite's lock (timeout 0), never checkpoints.
        self._inline = sqlite3.connect(path, timeout=0, isolation_level=None, check_same_thread=False)
        self._inline.execute("PRAGMA synchronous=NORMAL")
        self._inline.execute("PRAGMA wal_autocheckpoint=0")

    def add(self, record: UsageRecord) -> None:
        with self._lock:
            self._db.execute(_INSERT, (record.request_id, _encode(record)))

    def try_add(self, record: UsageRecord) -> bool:
        """`add` if it needs no wait (see the module's docstring); False: nothing was written."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._inline.execute(_INSERT, (record.request_id, _encode(record)))
        except sqlite3.OperationalError as error:
            if "locked" in str(error) or "busy" in str(error):
                return False  # another connection is writing: the statement was rolled back
            raise
        finally:
            self._lock.release()
        return True

    def claim(self, owner: str, limit: int, lease_s: float = 60.0) -> list[tuple[int, UsageRecord]]:
        """Rows nobody holds (or whose holder's claim lapsed), now held by `owner` for `lease_s`."""
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                rows = self._db.execute(
                    "SELECT id, body FROM outbox WHERE claimed_by IS NULL OR claimed_until < ? "
                    "ORDER BY id LIMIT ?",
                    (now, limit),
                ).fetchall()
                self._db.executemany(
                    "UPDATE outbox SET claimed_by = ?, claimed_until = ? WHERE id = ?",
                    [(owner, now + lease_s, row[0]) for row in rows],
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return [(row[0], _decode(row[1])) for row in rows]

    def done(self, ids: list[int]) -> None:
        with self._lock:
            self._db.executemany("DELETE FROM outbox WHERE id = ?", [(i,) for i in ids])

    def release(self, ids: list[int]) -> None:
        """Give rows back after a failed delivery, so any replica may retry them."""
        with self._lock:
            self._db.executemany("UPDATE outbox SET claimed_by = NULL WHERE id = ?", [(i,) for i in ids])

    def pending(self) -> int:
        with self._lock:
            row = self._db.execute("SELECT COUNT(*) FROM outbox").fetchone()
        return int(row[0])

    def close(self) -> None:
        with self._lock:
            self._inline.close()
            self._db.close()
