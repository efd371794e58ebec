"""Metering throughput: usage records per second the metering write path (batched insert-or-ignore, as the
Metering deployment does it) sustains into SQLite and PostgreSQL, against writing one row per transaction
(what a naive per-request write would do), in the same run on the same database.

Run: python -m bench.metering [--records 20000] [--batch 500]; the last line is one JSON object.
PostgreSQL: LORAPLEX_BENCH_POSTGRES (default postgresql://postgres@127.0.0.1:5432/test; a scratch database
is created and dropped).
"""

import argparse
import json
import os
import tempfile
import time
import uuid
from dataclasses import asdict
from datetime import UTC, datetime

import psycopg

from app.metering.database_sink import DatabaseSink
from billing.db import make_engine, make_session_factory
from billing.migrate import upgrade
from billing.models import UsageEvent
from billing.usage import UsageRecord


def records(n: int) -> list[UsageRecord]:
    now = datetime.now(UTC)
    return [
        UsageRecord(
            f"req_{uuid.uuid4().hex}", f"ten_{i % 50:020d}", "key_x", "m", "base", None, None, "completed",
            "stop", 120, 32, 64, 12.5, 1.0, 30.0, 250.0, "replica-1", now, now,
        )
        for i in range(n)
    ]  # fmt: skip


def batched(url: str, data: list[UsageRecord], batch: int) -> float:
    sink = DatabaseSink(make_session_factory(make_engine(url)))
    start = time.perf_counter()
    for i in range(0, len(data), batch):
        sink.write(data[i : i + batch])
    return len(data) / (time.perf_counter() - start)


def row_by_row(url: str, data: list[UsageRecord]) -> float:
    sessions = make_session_factory(make_engine(url))
    start = time.perf_counter()
    for record in data:
        with sessions() as session, session.begin():
            session.add(UsageEvent(**asdict(record), recorded_at=datetime.now(UTC)))
    return len(data) / (time.perf_counter() - start)


def measure(url: str, n: int, batch: int) -> tuple[float, float]:
    upgrade(url)
    fast = batched(url, records(n), batch)
    slow = row_by_row(url, records(max(500, n // 20)))  # slow: fewer rows suffice for a rate
    return fast, slow


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--tiny", action="store_true", help="300 records: checks the bench runs")
    args = parser.parse_args()
    if args.tiny:
        args.records, args.batch = 300, 100
    result: dict[str, object] = {"records": args.records, "batch": args.batch}
    sqlite_fast, sqlite_slow = measure(f"sqlite:///{tempfile.mkdtemp()}/bench.db", args.records, args.batch)
    admin = os.environ.get("LORAPLEX_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
    name = f"bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        pg_url = admin.rsplit("/", 1)[0] + f"/{name}"
        pg_fast, pg_slow = measure(pg_url, args.records, args.batch)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    result.update(
        sqlite_events_per_s=round(sqlite_fast),
        sqlite_row_by_row_per_s=round(sqlite_slow),
        sqlite_ratio=round(sqlite_fast / sqlite_slow, 1),
        postgres_events_per_s=round(pg_fast),
        postgres_row_by_row_per_s=round(pg_slow),
        postgres_ratio=round(pg_fast / pg_slow, 1),
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
