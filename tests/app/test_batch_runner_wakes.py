"""The batch runner is woken, never left to its poll (app/batches/runner.py): with a 30 s poll interval, a
batch created on a replica starts there at once, and each line's end starts the next, so a batch of 12
lines two at a time finishes in a few seconds. Before, a created batch waited for the next poll (up to 30
s here), and a line that ended while the runner was claiming lost its wake-up (the tick cleared it after
the claim), leaving the engine idle until the poll."""

import asyncio
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import select

from app.batches.runner import BatchRunner
from app.settings import BatchesConfig
from billing.models import Batch
from tests.app.conftest import Served, serving
from tests.app.test_batch_runner import FINAL
from tests.app.test_batches_api import create, request_line
from tests.app.test_files_api import client_for, jsonl, upload
from tests.model_fixtures import TinySetup

POLL_S = 30.0
LINES = 12


@pytest.fixture(scope="module")
def served(llama: TinySetup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    batches = BatchesConfig(poll_interval_s=POLL_S, lease_s=3 * POLL_S, max_in_flight_per_tenant=2)
    with serving(llama, tmp_path_factory.mktemp("wakes"), batches=batches) as app:
        time.sleep(0.5)  # the runner's first tick (at its start) has passed: it waits for its poll now
        yield app


def _status(served: Served, batch_id: str) -> str | None:
    with served.services.session_factory() as s:
        return s.scalar(select(Batch.status).where(Batch.id == batch_id))


def test_a_batch_starts_at_once_and_its_lines_follow_each_other_without_waiting_for_the_poll(
    served: Served,
) -> None:
    _, client = client_for(served)
    lines = [request_line("/v1/completions", f"l-{i}", max_tokens=4, temperature=0) for i in range(LINES)]
    started = time.monotonic()
    batch = create(client, upload(client, jsonl(lines)).id, "/v1/completions")
    while (status := _status(served, batch.id)) not in FINAL:  # read in the database: the API's reads
        assert time.monotonic() - started < POLL_S / 2, f"batch still {status}"  # are rate limited
        time.sleep(0.05)
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.request_counts is not None
    assert done.request_counts.completed == LINES


class _CountingRunner(BatchRunner):
    """Its first tick is woken during itself, as by a line that ends while the runner claims."""

    ticks = 0

    async def tick(self) -> None:
        self.ticks += 1
        if self.ticks == 1:
            self.wake()


def test_a_wake_during_a_tick_runs_the_next_tick_at_once(served: Served) -> None:
    async def ticks_in_a_second() -> int:
        runner = _CountingRunner(served.services, owner="probe")
        runner.start()
        await asyncio.sleep(1.0)
        await runner.stop()
        return runner.ticks

    assert asyncio.run(ticks_in_a_second()) == 2  # then it waits for its poll (30 s)
