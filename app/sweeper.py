"""Sweeper: deletes what expired, for every tenant, on a timer, from each ingress's lifespan: stored responses
(ResponseStore.sweep) and files (FileStore.sweep, with their bytes). The hourly storage charge
(StorageBilling.charge) runs on one too: a bounded, idempotent round like theirs.

Expired rows already read as missing; this frees their space even for a tenant that never stores again (an
idle flooder's rows stayed until it did). Every ingress replica sweeps; the deletes are idempotent and
batched, so replicas racing each other only find less to delete.
"""

import asyncio
import logging
from collections.abc import Callable

from starlette.concurrency import run_in_threadpool

log = logging.getLogger(__name__)


class Sweeper:
    def __init__(self, what: str, sweep: Callable[[], int], interval_s: float) -> None:
        """`what`: the things swept, for logs; `sweep`: one bounded, blocking round (run in a thread),
        returning how many it deleted."""
        self.what = what
        self.sweep = sweep
        self.interval_s = interval_s
        self.swept = 0  # deleted by this sweeper
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"sweeper-{self.what}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def sweep_once(self) -> int:
        deleted = await run_in_threadpool(self.sweep)
        self.swept += deleted
        return deleted

    async def _run(self) -> None:
        while True:
            try:
                await self.sweep_once()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the database or the store is away: the next round tries again
                log.warning("%s: this round failed, the next tries again: %s", self.what, error)
            await asyncio.sleep(self.interval_s)
