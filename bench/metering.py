"""Metering throughput: usage records per second the metering write path (batched insert-or-ignore, as the
Metering deployment does it) sustains into SQLite and PostgreSQL, against writing one row per transaction
(what a naive per-request write would do), in the same run on the same database.

The four peers (two write paths on two databases) run in turns, --repeats rounds, each on fresh records;
a ratio is taken per round and reported as its median and spread.
Run: python -m bench.metering [--records 20000] [--batch 500] [--repeats 5]; the last line is one JSON
object.
PostgreSQL: LORAPLEX_BENCH_POSTGRES (default postgresql://postgres@127.0.0.1:5432/test; a scratch database
is created and dropped).
"""

import argparse
import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from functools import partial

import psycopg
from sqlalchemy.orm import Session, sessionmaker

from app.metering.database_sink import DatabaseSink
from bench.measure import Interleaved, machine
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


def batched(sink: DatabaseSink, n: int, batch: int) -> float:
    data = records(n)
    start = time.perf_counter()
    for i in range(0, len(data), batch):
        sink.write(data[i : i + batch])
    return len(data) / (time.perf_counter() - start)


def row_by_row(sessions: sessionmaker[Session], n: int) -> float:
    data = records(n)
    start = time.perf_counter()
    for record in data:
        with sessions() as session, session.begin():
            session.add(UsageEvent(**asdict(record), recorded_at=datetime.now(UTC)))
    return len(data) / (time.perf_counter() - start)


def peers(db: str, url: str, n: int, batch: int, slow_n: int) -> dict[str, Callable[[], float]]:
    """Both write paths on one (migrated) database, each a callable giving records per second."""
    upgrade(url)
    sessions = make_session_factory(make_engine(url))
    return {
        f"{db}_batched": partial(batched, DatabaseSink(sessions), n, batch),
        f"{db}_row_by_row": partial(row_by_row, sessions, slow_n),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5, help="rounds of the four peers")
    parser.add_argument("--tiny", action="store_true", help="300 records, 2 rounds: checks the bench runs")
    args = parser.parse_args()
    if args.tiny:
        args.records, args.batch, args.repeats = 300, 100, 2
    slow_n = 100 if args.tiny else max(500, args.records // 20)  # slow: fewer rows suffice for a rate
    result: dict[str, object] = {"records": args.records, "batch": args.batch, "repeats": args.repeats}
    admin = os.environ.get("LORAPLEX_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
    name = f"bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        sqlite = peers("sqlite", f"sqlite:///{tempfile.mkdtemp()}/bench.db", args.records, args.batch, slow_n)
        pg_url = admin.rsplit("/", 1)[0] + f"/{name}"
        runs = Interleaved(
            {**sqlite, **peers("postgres", pg_url, args.records, args.batch, slow_n)}, repeats=args.repeats
        ).run()
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    for db in ("sqlite", "postgres"):
        ratio = runs.ratio(f"{db}_batched", f"{db}_row_by_row")
        result.update({
            f"{db}_events_per_s": round(runs.median(f"{db}_batched")),
            f"{db}_row_by_row_per_s": round(runs.median(f"{db}_row_by_row")),
            f"{db}_ratio": round(ratio["median"], 1),
            f"{db}_ratio_spread": ratio,
        })  # fmt: skip
        print(f"{db}: batched / row by row x{ratio['median']:.1f} ({ratio['min']:.1f}..{ratio['max']:.1f})")
    result["events_per_s"] = runs.summary()
    result["machine"] = machine()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
