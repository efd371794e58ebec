"""UsageDelivery: the ingress's background task moving usage records from the outbox to metering.

It batches (a write per request would be slow), starts a round at most `gather_s` after a record arrives
(the records that arrive meanwhile ride the same round: one claim, one write, one delete, not four thread
hops per request) and backs off while metering is unreachable; records stay in the outbox until metering
has acknowledged them. After each round it publishes the outbox's size as the metering backlog gauge.
"""

import asyncio
import contextlib
import logging
import uuid
from typing import Protocol

from starlette.concurrency import run_in_threadpool

from app.metering.outbox import Outbox
from app.metrics import Counter, Gauge
from billing.usage import UsageRecord

log = logging.getLogger(__name__)
# The node's outbox, shared by its ingress replicas: each replica reports the same number for its node.
BACKLOG = Gauge("loraplex_metering_backlog", "Usage records in the outbox, not yet in the database.", ())
FAILURES = Counter(
    "loraplex_metering_delivery_failures", "Delivery rounds that failed (metering or its database away).", ()
)


class MeteringSink(Protocol):
    async def record(self, records: list[UsageRecord]) -> int:
        """Store the records (ignoring ids already stored); returns how many were new."""
        ...


class UsageDelivery:
    def __init__(
        self,
        outbox: Outbox,
        sink: MeteringSink,
        *,
        batch: int = 500,
        max_backoff_s: float = 30.0,
        claim_lease_s: float = 60.0,
        gather_s: float = 0.05,
    ) -> None:
        self.outbox = outbox
        self.sink = sink
        self.batch = batch
        # A claim outlives any delivery attempt; if this replica dies holding it, others take over after.
        self.claim_lease_s = claim_lease_s
        self.max_backoff_s = max_backoff_s
        self.gather_s = gather_s
        self.owner = f"ingress-{uuid.uuid4().hex[:12]}"
        self._wake = asyncio.Event()
        self._gathering: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self.delivered = 0
        self.failures = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="usage-delivery")

    def wake(self) -> None:
        """A round now."""
        self._wake.set()

    def soon(self) -> None:
        """A round within `gather_s`: a record arrived. A round already due takes this one's records too,
        so a busy ingress pays one round per `gather_s`, not one per request."""
        if self._wake.is_set() or self._gathering is not None:
            return
        self._gathering = asyncio.get_running_loop().call_later(self.gather_s, self._gathered)

    def _gathered(self) -> None:
        self._gathering = None
        self._wake.set()

    async def stop(self) -> None:
        if self._gathering is not None:
            self._gathering.cancel()
            self._gathering = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def deliver_once(self) -> int:
        """One batch; returns how many records left the outbox. Raises if metering failed."""
        claimed = await run_in_threadpool(self.outbox.claim, self.owner, self.batch, self.claim_lease_s)
        if not claimed:
            return 0
        ids = [i for i, _ in claimed]
        try:
            await self.sink.record([r for _, r in claimed])
        except BaseException:
            await run_in_threadpool(self.outbox.release, ids)
            raise
        await run_in_threadpool(self.outbox.done, ids)
        self.delivered += len(ids)
        return len(ids)

    async def publish_backlog(self) -> None:
        try:
            BACKLOG.set(await run_in_threadpool(self.outbox.pending), {})
        except Exception as error:  # the outbox is busy, or metrics are: try again next round
            log.warning("metering backlog not published: %s", error)

    async def _run(self) -> None:
        backoff = 0.5
        while True:
            self._wake.clear()  # before the round: a record added during it wakes the next one
            try:
                while await self.deliver_once() == self.batch:
                    pass  # a full batch: there may be more right away
                backoff = 0.5
                timeout = 5.0  # also sweeps rows other replicas left behind
            except asyncio.CancelledError:
                raise
            except Exception as error:
                self.failures += 1
                FAILURES.inc({})
                log.warning("usage delivery failed, retrying in %.1fs: %s", backoff, error)
                timeout, backoff = backoff, min(backoff * 2, self.max_backoff_s)
            await self.publish_backlog()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
