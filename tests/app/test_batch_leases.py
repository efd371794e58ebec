"""Line leases (app/batches/leases.py) on each database: runners on several replicas claiming at once from
several batches of one tenant keep it within `max_in_flight_per_tenant`, and each line is claimed once."""

import io
import json
import threading

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.batches.leases import Claimed, LineLeases
from app.batches.store import BatchStore, NewBatch
from app.settings import BatchesConfig
from billing import repository as repo
from billing.models import BatchLine

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
