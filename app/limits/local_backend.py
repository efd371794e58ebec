"""LocalLimiter: WaitingState in this process, correct for one ingress replica (tests, single-process
tools); a Serve deployment with several ingress replicas shares a Ray actor or Redis instead."""

from app.limits.protocol import DEFAULT_MAX_WAITERS, Decision, LimiterBackend, Limits, WindowState
from app.limits.waiting_state import WaitingState


class LocalLimiter(LimiterBackend):
    def __init__(self, *, max_waiters_per_tenant: int = DEFAULT_MAX_WAITERS) -> None:
        self.waiting = WaitingState(max_waiters_per_tenant)
        self.state = self.waiting.state

    async def admit(
        self,
        tenant: str,
        request_id: str,
        limits: Limits,
        reserve_tokens: int,
        *,
        wait_ms: int = 0,
        sequences: int = 1,
    ) -> Decision:
        return await self.waiting.admit(
            tenant, request_id, limits, reserve_tokens, wait_ms=wait_ms, sequences=sequences
        )

    async def release(self, tenant: str, request_id: str, used_tokens: int) -> None:
        self.waiting.release(tenant, request_id, used_tokens)

    async def renew(self, tenant: str, request_id: str, limits: Limits) -> None:
        self.waiting.renew(tenant, request_id, limits.lease_ttl_ms)

    async def deliver(self, tenant: str, request_id: str) -> None:
        self.waiting.deliver(tenant, request_id)

    async def leave_queue(self, tenant: str, request_id: str) -> None:
        self.waiting.leave_queue(tenant, request_id)

    async def peek(self, tenant: str) -> WindowState:
        return self.waiting.peek(tenant)
