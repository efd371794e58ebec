"""WaitingState: LimiterState with the waiting done where the state lives (this process, or the Ray actor).

A queued admit joins the tenant's FIFO queue once and then sleeps: the head is woken when a lease or a
place is given back, and every waiter re-checks at least every HEARTBEAT_MS (which also keeps its place)
or when the window's oldest entry leaves, whichever is sooner. Nothing polls on a short fixed period, and a
tenant never has more than `max_waiters` waiters: past that, admit answers `queue_full` at once.

All state changes happen on one thread without awaiting in between, so each check stays atomic.
"""

import time

from app.limits.protocol import FINAL_REASONS, Decision, Limits, WindowState, check_wait
from app.limits.state import HEARTBEAT_MS, LimiterState
from app.limits.wakeups import Wakeups


class WaitingState:
    def __init__(self, max_waiters: int) -> None:
        self.state = LimiterState()
        self.max_waiters = max_waiters
        self._wakeups = Wakeups()

    async def admit(
        self,
        tenant: str,
        request_id: str,
        limits: Limits,
        reserve: int,
        *,
        wait_ms: int = 0,
        sequences: int = 1,
    ) -> Decision:
        wait_ms = check_wait(wait_ms)
        queued = wait_ms > 0
        decision = self._check(tenant, request_id, limits, reserve, sequences, queued=queued)
        if decision.admitted or not queued or decision.reason in FINAL_REASONS:
            return decision
        deadline = time.monotonic() + wait_ms / 1000
        waiter = self._wakeups.join(tenant, request_id)
        try:
            while not waiter.left and (left := deadline - time.monotonic()) > 0:
                nap_ms = HEARTBEAT_MS
                if decision.reason in ("requests", "tokens"):  # the window makes room at a known time
                    nap_ms = min(nap_ms, max(1, decision.retry_after_ms))
                await waiter.nap(min(left, nap_ms / 1000))
                if waiter.left:
                    break
                decision = self._check(tenant, request_id, limits, reserve, sequences, queued=True)
                if decision.admitted:
                    return decision
            return decision
        finally:
            self._wakeups.leave(tenant, request_id, waiter)
            if not decision.admitted:  # timed out, left, or cancelled: give the place to the next one
                self.leave_queue(tenant, request_id)

    def _check(
        self, tenant: str, request_id: str, limits: Limits, reserve: int, sequences: int, *, queued: bool
    ) -> Decision:
        decision = self.state.admit(
            tenant,
            request_id,
            limits,
            reserve,
            queued=queued,
            max_waiters=self.max_waiters,
            sequences=sequences,
        )
        if decision.admitted and queued:  # the head went: the next one may fit too
            self._wake_head(tenant)
        return decision

    def release(self, tenant: str, request_id: str, used: int) -> None:
        self.state.release(tenant, request_id, used)
        self._wake_head(tenant)

    def renew(self, tenant: str, request_id: str, ttl_ms: int) -> None:
        self.state.renew(tenant, request_id, ttl_ms)

    def deliver(self, tenant: str, request_id: str) -> None:
        self.state.deliver(tenant, request_id)

    def leave_queue(self, tenant: str, request_id: str) -> None:
        waiter = self._wakeups.get(tenant, request_id)
        if waiter is not None:  # its caller gave up while it sleeps here: end that wait now
            waiter.left = True
            waiter.wake()
        self.state.leave_queue(tenant, request_id)
        self._wake_head(tenant)

    def peek(self, tenant: str) -> WindowState:
        return self.state.peek(tenant)

    def _wake_head(self, tenant: str) -> None:
        if self._wakeups.waiting(tenant):
            self._wakeups.wake_first(tenant, self.state.queue_order(tenant))
