"""How long the batch runner's claim takes against a large batch, and what its index costs at creation
(issue 37): a fresh SQLite database (every migration), one batch in progress with N queued lines over 8
models and 4 prompt openings, inserted as BatchStore inserts them (Core inserts of 1,000 rows); then K
claims of `--room` lines through the real `LineLeases.claim`, each put back to `queued` after (so every
claim faces the whole batch). The claim holds the tenant's lock and, on SQLite, the write lock.

`--vs DIR --runs N`: this checkout and DIR's (a repository root, e.g. `git worktree add DIR <commit>` before
a change) each run this script N times in turns, as child processes with the other flags; the JSON then
has each side's medians and the per-pair ratios ref / this.
Run:  python -m bench.batch_claims [--lines 50000 --claims 20 --room 16] [--vs DIR --runs 5] [--tiny]
The last line is one JSON object.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import insert, update

from app.batches.leases import LineLeases
from app.settings import BatchesConfig
from billing import repository
from billing.db import make_engine, make_session_factory
from billing.migrate import upgrade
from billing.models import Batch, BatchLine, utcnow

PREFIXES = ["You label support tickets. " * 8, "Summarise the text. " * 10, "Translate to French. " * 9,
            "Answer in one word. " * 10]  # fmt: skip


def build(url: str, lines: int) -> tuple[Any, str, float]:
    """The database with one batch in progress of `lines` queued lines; (sessions, batch id, insert s)."""
    upgrade(url)
    sessions = make_session_factory(make_engine(url))
    with sessions() as s, s.begin():
        tenant = repository.create_tenant(s, name="bench", tier="free")
        now = utcnow()
        s.add(Batch(id="batch_bench", tenant_id=tenant.id, key_id="key", endpoint="/v1/completions",
                    input_file_id="file_bench", completion_window="24h", status="in_progress", total=lines,
                    created_at=now, expires_at=now + timedelta(hours=24), in_progress_at=now))  # fmt: skip
    rows = [
        {"batch_id": "batch_bench", "line": i + 1, "custom_id": f"c{i}", "request_id": f"req_bench_{i}",
         "model": f"ad{i % 8}", "prefix": PREFIXES[i % 4][:256], "body": {"prompt": f"p{i}"},
         "state": "queued", "attempts": 0, "lost": 0}
        for i in range(lines)
    ]  # fmt: skip
    start = time.perf_counter()
    with sessions() as s, s.begin():
        for first in range(0, lines, 1000):
            s.execute(insert(BatchLine), rows[first : first + 1000])
    return sessions, "batch_bench", time.perf_counter() - start


def claims(sessions: Any, batch_id: str, count: int, room: int) -> list[float]:
    """Milliseconds of each of `count` claims of `room` lines; each claim's lines go back to the queue."""
    leases = LineLeases(sessions, BatchesConfig(max_in_flight_per_tenant=room, max_in_flight=room))
    times = []
    for _ in range(count):
        start = time.perf_counter()
        got = leases.claim("bench-runner", room)
        times.append((time.perf_counter() - start) * 1000)
        assert len(got) == room, f"claimed {len(got)} of {room}"
        with sessions() as s, s.begin():
            s.execute(
                update(BatchLine)
                .where(BatchLine.batch_id == batch_id, BatchLine.line.in_([c.line for c in got]))
                .values(state="queued", lease_owner=None, lease_expires_at=None, attempts=0)
            )
    return times


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="batch-claims-") as work:
        sessions, batch_id, insert_s = build(f"sqlite:///{Path(work) / 'db.sqlite'}", args.lines)
        claims(sessions, batch_id, 2, args.room)  # warm: the first statements compile
        times = claims(sessions, batch_id, args.claims, args.room)
    return {
        "lines": args.lines,
        "claims": args.claims,
        "room": args.room,
        "claim_ms": round(statistics.median(times), 3),
        "insert_s": round(insert_s, 3),
    }


def versus(ref: str, runs: int, child_args: list[str]) -> dict[str, Any]:
    from bench.measure import checkouts_in_turns, spread  # here: a ref checkout's bench.measure may differ

    checkouts = {"this": str(Path.cwd()), "ref": ref}
    results = checkouts_in_turns(Path(__file__).resolve(), child_args, checkouts, runs=runs)
    pairs = list(zip(results["this"], results["ref"], strict=True))
    return {
        "checkouts": {"this": str(Path.cwd()), "ref": str(Path(ref).resolve())},
        "runs": runs,
        "args": child_args,
        "claim_ms": {side: spread([r["claim_ms"] for r in results[side]]) for side in checkouts},
        "insert_s": {side: spread([r["insert_s"] for r in results[side]]) for side in checkouts},
        "ratio_claim_ref_vs_this": spread([b["claim_ms"] / a["claim_ms"] for a, b in pairs]),
        "ratio_insert_this_vs_ref": spread([a["insert_s"] / b["insert_s"] for a, b in pairs]),
    }


def main() -> None:
    from bench.measure import machine

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--claims", type=int, default=20)
    parser.add_argument("--room", type=int, default=16, help="lines a claim takes")
    parser.add_argument("--vs", metavar="DIR", help="compare with the checkout at DIR (see above)")
    parser.add_argument("--runs", type=int, default=5, help="with --vs: runs of each checkout, in turns")
    parser.add_argument("--tiny", action="store_true", help="500 lines, 3 claims: checks it runs")
    args = parser.parse_args()
    if args.tiny:
        args.lines, args.claims = 500, 3
    if args.vs:
        child = [a for a in sys.argv[1:] if a not in ("--vs", args.vs, "--runs", str(args.runs))]
        result = versus(args.vs, args.runs, child)
    else:
        result = run(args)
    result["machine"] = machine()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
