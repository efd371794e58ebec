"""BatchRunner: runs the Batch API's lines on each ingress replica, started and stopped with its services
(app/main.py's lifespan), as the sweepers are.

It claims queued lines up to its room (`max_in_flight`, and each tenant's `max_in_flight_per_tenant`
across replicas: app/batches/leases.py), runs each through its endpoint's request lifecycle
(app/batches/line_run.py: the `batch` engine class, the line's fixed request id, its money held, not the
interactive rate limits) and ends it with its answer; every `interval_s` it renews its lines' leases and
finalizes the batches whose lines have all ended (app/batches/finalize.py). A line the platform failed
(5xx, or a 429 that is not the tenant's money) goes back to the queue until `max_attempts`, unbilled, and
runs again after a wait that doubles at each try (`retry_base_s` up to `retry_max_s`: an engine that is down
or restarting does not use up its attempts), and past them goes to the error file, the hold its last try
kept for a retry freed at once; a line's own failure (4xx, `insufficient_quota`) goes to the error file.
Stopping a runner abandons its lines: their leases lapse and another runner claims them (their request ids
are fixed, so each is billed once). It reports the lines queued and running by tenant, and counts each claim
and end (app/batches/metrics.py).
"""

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections import Counter
from typing import Any

from starlette.concurrency import run_in_threadpool

from app.auth.authenticator import Principal
from app.batches.finalize import Finisher
from app.batches.leases import Claimed, LineLeases
from app.batches.line_run import Answer, run_line
from app.batches.metrics import LINES_CLAIMED, LINES_ENDED, LINES_QUEUED, LINES_RUNNING, TenantGauge
from app.services import Services

log = logging.getLogger(__name__)
PRINCIPAL_TTL_S = 5.0  # a tenant's tier and budget flags, as the authenticator caches them
GONE = {"code": "tenant_not_found", "message": "The batch's tenant no longer exists."}


def _retryable(answer: Answer) -> bool:
    """The platform's failure, not the line's: worth another try."""
    return answer.status_code >= 500 or (answer.status_code == 429 and answer.code != "insufficient_quota")


class BatchRunner:
    def __init__(self, services: Services, owner: str | None = None) -> None:
        self.services = services
        self.config = services.settings.batches
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.leases = LineLeases(services.session_factory, self.config)
        self.finisher = Finisher(services)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._lines: dict[asyncio.Task[None], Claimed] = {}
        self._wake = asyncio.Event()
        self._principals: dict[tuple[str, str], tuple[float, Principal | None]] = {}
        self._queued = TenantGauge(LINES_QUEUED)
        self._running = TenantGauge(LINES_RUNNING)
        self._housekept = 0.0  # when leases were last renewed, gauges reported, batches finalized
        self._ended_since_claim = 0

    def start(self) -> None:
        if self._task is None:
            self.loop = asyncio.get_running_loop()
            self._task = self.loop.create_task(self._run(), name=f"batch-runner-{self.owner}")

    async def stop(self) -> None:
        """Stop claiming and abandon the lines in flight (their engine requests stop; their leases lapse)."""
        tasks = [task for task in (self._task, *self._lines) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        self._lines.clear()
        self._running.report({})  # a stopped runner runs nothing

    @property
    def interval_s(self) -> float:
        return min(self.config.poll_interval_s, self.config.lease_s / 3)  # leases renewed thrice per life

    def wake(self) -> None:
        """Tick now (a batch was created here): its lines start at once, not at the next poll."""
        self._wake.set()

    async def _run(self) -> None:
        while True:
            self._wake.clear()  # before the tick: a line that ends during it wakes the next one
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the database is away: the next tick tries again
                log.warning("batch runner tick failed: %s", error)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)

    async def tick(self) -> None:
        """Claim and start lines; every `interval_s` (or when nothing runs) also renew the leases, report
        the gauges and finalize what ended. A line's end wakes a tick, so the claims keep the engine fed,
        but the rest is not repeated for each of a fast batch's lines (a few queries each)."""
        now = time.monotonic()
        due = now - self._housekept >= self.interval_s or not self._lines
        if due and self._lines:
            await run_in_threadpool(self.leases.renew, self.owner, list(self._lines.values()))
        room = self.config.max_in_flight - len(self._lines)
        if room > 0 and (due or self._ended_since_claim >= self.claim_at_least):
            self._ended_since_claim = 0
            for line in await run_in_threadpool(self.leases.claim, self.owner, room):
                task = asyncio.get_running_loop().create_task(self._line(line))
                self._lines[task] = line
                task.add_done_callback(self._ended)
                LINES_CLAIMED.inc({"tenant": line.tenant_id})
        self._running.report(Counter(line.tenant_id for line in self._lines.values()))
        if not due:
            return
        self._housekept = now
        self._queued.report(await run_in_threadpool(self.leases.queued_by_tenant))
        for batch_id in await run_in_threadpool(self.finisher.ready):
            await run_in_threadpool(self.finisher.finalize, batch_id)

    @property
    def claim_at_least(self) -> int:
        """Between housekeeping ticks, a claim waits for this many lines to end: one claim per few lines,
        while the lines still in flight keep the engine's queue from running dry."""
        return max(1, min(self.config.max_in_flight, self.config.max_in_flight_per_tenant) // 4)

    def _ended(self, task: "asyncio.Task[None]") -> None:
        self._lines.pop(task, None)
        self._ended_since_claim += 1
        self._wake.set()  # room for another line, and maybe a batch to finalize

    async def _line(self, line: Claimed) -> None:
        try:
            principal = await self._principal(line.tenant_id, line.key_id)
            if principal is None:
                await run_in_threadpool(self._finish, line, None, GONE)
                return
            answer = await run_line(self.services, principal, line)
            retryable = not answer.ok and _retryable(answer)
            if retryable and line.attempts < self.config.max_attempts:
                wait_s = min(self.config.retry_max_s, self.config.retry_base_s * 2 ** (line.attempts - 1))
                if await run_in_threadpool(self.leases.requeue, self.owner, line, wait_s):
                    LINES_ENDED.inc({"tenant": line.tenant_id, "outcome": "requeued"})
                return
            response = {"status_code": answer.status_code, "body": answer.body}
            ended = await run_in_threadpool(self._finish, line, response, None, answer.ok)
            guard = self.services.budget_guard
            if retryable and ended and guard is not None:  # its last try kept its hold for a retry
                await guard.drop(line.tenant_id, line.request_id)
        except asyncio.CancelledError:
            raise
        except Exception:  # no longer renewed, its lease lapses and another try runs it
            log.exception("batch line %s:%d failed to run", line.batch_id, line.line)

    def _finish(
        self, line: Claimed, response: dict[str, Any] | None, error: dict[str, Any] | None, ok: bool = False
    ) -> bool:
        """End the line; whether it was still this runner's to end."""
        if not self.leases.finish(self.owner, line, ok=ok, response=response, error=error):
            log.info("batch line %s:%d was no longer this runner's", line.batch_id, line.line)
            return False
        LINES_ENDED.inc({"tenant": line.tenant_id, "outcome": "done" if ok else "failed"})
        return True

    async def _principal(self, tenant_id: str, key_id: str) -> Principal | None:
        key = (tenant_id, key_id)
        cached = self._principals.get(key)
        now = time.monotonic()
        if cached is not None and cached[0] > now:
            return cached[1]
        principal = await run_in_threadpool(self.services.authenticator.principal_for, tenant_id, key_id)
        if len(self._principals) > 10_000:
            self._principals.clear()
        self._principals[key] = (now + PRINCIPAL_TTL_S, principal)
        return principal
