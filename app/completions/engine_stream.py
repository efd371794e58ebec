"""EngineStream: one engine request's outputs, read so that a caller who leaves can still bill it.

Every request that reached an engine is billed with what that engine processed, whenever its client
leaves. So the request announces itself (the engine's `accepted` output names the replica holding it),
reads run as their own tasks (a cancelled reader never loses an output that was already on its way), and
`stop` asks that replica to abort the request and waits, bounded, for the final output with its usage.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

from deployments.engine.interface import EngineClient, EngineRequest, RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")


async def uncancellable(work: Awaitable[T]) -> T:
    """Run `work` to its end even if the caller is cancelled meanwhile (cleanup that must happen: billing,
    releasing a lease). The caller's cancellation is delivered again afterwards."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done() and task.cancelled():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


class EngineStream:
    def __init__(self, client: EngineClient, base_model: str, request: EngineRequest) -> None:
        self.client = client
        self.base_model = base_model
        self.request = request
        self._outputs: AsyncGenerator[RequestOutput, None] = client.generate(base_model, request)
        self._read_task: asyncio.Task[RequestOutput] | None = None
        self.replica: str | None = None  # the engine replica that accepted it
        self.last: RequestOutput | None = None  # the latest output, the acceptance included (usage so far)
        self.finished = False
        self._closed = False

    @property
    def accepted(self) -> bool:
        return self.replica is not None or self.finished

    async def next(self) -> RequestOutput:
        """The next output with tokens or the final one; raises StopAsyncIteration after the final."""
        while True:
            out = await self._read()
            if not out.accepted:
                return out

    async def _read(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        if self._read_task is None:
            self._read_task = asyncio.ensure_future(self._read_one())
        task = self._read_task
        out = await asyncio.shield(task)
        self._read_task = None
        return out

    async def _read_one(self) -> RequestOutput:
        # Recorded here, not by the reader: an output that arrives as its reader is cancelled still counts.
        out = await anext(self._outputs)
        self.last = out
        if out.accepted and out.usage is not None:
            self.replica = out.usage.replica
        self.finished = out.finished
        return out

    async def stop(self, wait_s: float) -> RequestOutput | None:
        """The caller is leaving: stop the request and return its final output (its usage), or the last
        one seen if the engine does not answer within `wait_s`. Never raises; closes the stream."""
        try:
            async with asyncio.timeout(wait_s):
                await self._stop()
        except Exception as error:  # TimeoutError included
            log.warning("request %s: no final usage from its engine: %r", self.request.request_id, error)
        await self.close()
        return self.last

    async def _stop(self) -> None:
        while not self.accepted:  # queued at the router, or its acceptance is on its way: wait for it
            try:
                await self._read()
            except StopAsyncIteration:
                return
        if self.finished:
            return
        asked = await self.client.abort(self.base_model, self.request.request_id, self.replica)
        if not asked:  # finished meanwhile (its final is on the way), or unreachable (timeout ends it)
            log.debug("abort of %s found nothing to stop on %s", self.request.request_id, self.replica)
        while not self.finished:  # the tokens still in flight, then the ABORT output with the usage
            try:
                await self._read()
            except StopAsyncIteration:
                return

    async def close(self) -> None:
        """Close the engine stream (an unfinished one is cancelled at the engine). Idempotent."""
        if self._closed:
            return
        self._closed = True
        task, self._read_task = self._read_task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):  # its cancellation, or the error it ended with
                await task
        try:
            await self._outputs.aclose()
        except Exception as error:  # closing a stream whose replica is gone: nothing left to stop
            log.debug("closing engine stream of %s: %r", self.request.request_id, error)
