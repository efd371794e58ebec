"""Wakeups: the waiters sleeping in one process, per tenant, each woken when its turn may have come.

A waiter joins once for its whole wait and naps between checks; a wake that arrives while it is checking
is kept for its next nap, so none is lost. Waking is safe from any thread (tests and tools release leases
from another event loop): it goes through the sleeper's own loop.
"""

import asyncio
import contextlib
from collections.abc import Iterable


class Waiter:
    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        self.left = False  # its caller gave up (leave_queue): stop waiting, admit nothing

    async def nap(self, timeout_s: float) -> None:
        """Sleep until woken or for timeout_s, whichever comes first."""
        if timeout_s > 0 and not self._event.is_set():
            try:
                async with asyncio.timeout(timeout_s):
                    await self._event.wait()
            except TimeoutError:
                pass
        self._event.clear()

    def wake(self) -> None:
        with contextlib.suppress(RuntimeError):  # its loop has closed: nobody sleeps there any more
            self._loop.call_soon_threadsafe(self._event.set)


class Wakeups:
    def __init__(self) -> None:
        self._waiting: dict[str, dict[str, Waiter]] = {}  # tenant -> request id -> waiter, join order

    def join(self, tenant: str, request_id: str) -> Waiter:
        waiter = Waiter()
        self._waiting.setdefault(tenant, {})[request_id] = waiter
        return waiter

    def leave(self, tenant: str, request_id: str, waiter: Waiter) -> None:
        waiting = self._waiting.get(tenant, {})
        if waiting.get(request_id) is waiter:
            del waiting[request_id]
            if not waiting:
                self._waiting.pop(tenant, None)

    def get(self, tenant: str, request_id: str) -> Waiter | None:
        return self._waiting.get(tenant, {}).get(request_id)

    def wake_first(self, tenant: str, order: Iterable[str] = ()) -> None:
        """Wake the first of `order` (the queue, head first) that sleeps here, else the earliest joined:
        only the head can go next, so waking the rest would only make them check in vain."""
        waiting = self._waiting.get(tenant)
        if not waiting:
            return
        for request_id in order:
            waiter = waiting.get(request_id)
            if waiter is not None:
                waiter.wake()
                return
        earliest = next(iter(list(waiting.values())), None)  # a copy: another thread may be joining
        if earliest is not None:
            earliest.wake()

    def waiting(self, tenant: str) -> int:
        return len(self._waiting.get(tenant, {}))
