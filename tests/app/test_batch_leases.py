"""Line leases (app/batches/leases.py) on each database: runners on several replicas claiming at once from
several batches of one tenant keep it within `max_in_flight_per_tenant`, and each line is claimed once;
lines are claimed by model, then by the opening of their prompts; a line whose runner keeps stopping fails
after `max_lost` losses."""

import io
import itertools
import json
import threading
from datetime import timedelta

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from app.batches.leases import Claimed, LineLeases
from app.batches.store import BatchStore, NewBatch
from app.settings import BatchesConfig
from billing import repository as repo
from billing.models import BatchLine, utcnow

CAP = 3
RUNNERS = 8
BATCHES = 4


def _batch(store: BatchStore, tenant_id: str, lines: int) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    line = {"method": "POST", "url": "/v1/chat/completions", "body": body}
    raw = "".join(json.dumps({"custom_id": f"c{i}", **line}) + "\n" for i in range(lines)).encode()
    new = NewBatch(tenant_id, "key_1", "/v1/chat/completions", "file-1", "24h", None)
    return str(store.create_running(new, io.BytesIO(raw), lines)["id"])


def test_runners_claiming_at_once_keep_a_tenant_within_its_cap_across_its_batches(
    session_factory: sessionmaker[Session],
) -> None:
    with session_factory() as s, s.begin():
        tenant_id = repo.create_tenant(s, name="busy").id
        other_id = repo.create_tenant(s, name="other").id
    store = BatchStore(session_factory)
    for _ in range(BATCHES):
        _batch(store, tenant_id, 10)
    _batch(store, other_id, 10)
    leases = LineLeases(session_factory, BatchesConfig(lease_s=60.0, max_in_flight_per_tenant=CAP))
    start = threading.Barrier(RUNNERS)
    got: list[list[Claimed]] = [[] for _ in range(RUNNERS)]

    def runner(index: int) -> None:
        start.wait()
        got[index] = leases.claim(f"runner-{index}", room=100)

    threads = [threading.Thread(target=runner, args=(i,)) for i in range(RUNNERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    claimed = [line for lines in got for line in lines]
    by_tenant = {t: sum(line.tenant_id == t for line in claimed) for t in (tenant_id, other_id)}
    assert by_tenant == {tenant_id: CAP, other_id: CAP}
    assert len({(line.batch_id, line.line) for line in claimed}) == len(claimed)  # each line once
    with session_factory() as s:
        running = s.scalar(select(func.count()).select_from(BatchLine).where(BatchLine.state == "running"))
    assert running == 2 * CAP
    # Their room is spent until a line ends: another claim gets nothing.
    assert leases.claim("late", room=100) == []


def _batch_of(store: BatchStore, tenant_id: str, bodies: list[dict[str, object]]) -> str:
    url = "/v1/chat/completions"
    raw = "".join(
        json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": body}) + "\n"
        for i, body in enumerate(bodies)
    ).encode()
    new = NewBatch(tenant_id, "key_1", url, "file-1", "24h", None)
    return str(store.create_running(new, io.BytesIO(raw), len(bodies))["id"])


def test_lines_are_claimed_by_model_then_by_the_opening_of_their_prompts(
    session_factory: sessionmaker[Session],
) -> None:
    """A file that interleaves three long system prompts and two models: the claims take one model's lines
    at a time and, within it, the lines that share a system prompt one after another (file order within)."""
    with session_factory() as s, s.begin():
        tenant_id = repo.create_tenant(s, name="evals").id
    systems = [f"You grade answers for task {task}. " + "Be strict and brief. " * 20 for task in "CAB"]
    bodies: list[dict[str, object]] = [
        {
            "model": "m2" if i % 5 == 0 else "m1",
            "messages": [
                {"role": "system", "content": systems[i % 3]},
                {"role": "user", "content": f"question {i}"},
            ],
        }
        for i in range(30)
    ]
    _batch_of(BatchStore(session_factory), tenant_id, bodies)
    leases = LineLeases(session_factory, BatchesConfig(lease_s=60.0, max_in_flight_per_tenant=100))
    order = [line.line for line in leases.claim("runner", room=7)]
    order += [line.line for line in leases.claim("runner", room=100)]
    assert sorted(order) == list(range(1, 31))  # 1-based file lines

    def key(line: int) -> tuple[str, str]:
        body = bodies[line - 1]
        return str(body["model"]), str(body["messages"][0]["content"])  # type: ignore[index]

    runs = [key(line) for line in order]
    changes = sum(a != b for a, b in itertools.pairwise(runs))
    assert changes == 3 + 3 - 1  # each (model, system prompt) group once: 6 groups, 5 boundaries
    assert [key(line)[0] for line in order] == sorted(key(line)[0] for line in order)  # m1 before m2
    for group in set(runs):  # within a group, file order
        lines = [line for line in order if key(line) == group]
        assert lines == sorted(lines)


def test_a_line_whose_runner_keeps_stopping_fails_after_max_lost_not_max_attempts(
    session_factory: sessionmaker[Session],
) -> None:
    """Each claim's lease lapses unended (a line that takes down its replica): the third loss fails it as
    `batch_line_lost`, though five more claims remain for the platform's own failures."""
    with session_factory() as s, s.begin():
        tenant_id = repo.create_tenant(s, name="poison").id
    batch_id = _batch(BatchStore(session_factory), tenant_id, 1)
    config = BatchesConfig(lease_s=60.0, max_attempts=8, max_lost=3)
    leases = LineLeases(session_factory, config)

    def lapse() -> None:
        with session_factory() as s, s.begin():
            s.execute(
                update(BatchLine)
                .where(BatchLine.batch_id == batch_id)
                .values(lease_expires_at=utcnow() - timedelta(seconds=1))
            )

    def line() -> BatchLine:
        with session_factory() as s:
            row = s.scalar(select(BatchLine).where(BatchLine.batch_id == batch_id))
            assert row is not None
            return row

    for claim in range(3):
        got = leases.claim(f"runner-{claim}", room=10)
        assert [c.attempts for c in got] == [claim + 1] and line().lost == claim
        lapse()
    assert leases.claim("runner-3", room=10) == []
    failed = line()
    assert (failed.state, failed.attempts, failed.lost) == ("failed", 3, 3)
    assert failed.error is not None and failed.error["code"] == "batch_line_lost"
