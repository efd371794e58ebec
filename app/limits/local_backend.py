"""LocalLimiter: LimiterState in this process, correct for one ingress replica (tests, single-process
tools); a Serve deployment with several ingress replicas shares a Ray actor or Redis instead."""

from app.limits.protocol import Decision, LimiterBackend, Limits, WindowState
from app.limits.state import LimiterState


class LocalLimiter(LimiterBackend):
    def __init__(self) -> None:
        self.state = LimiterState()

    async def admit(
        self, tenant: str, request_id: str, limits: Limits, reserve_tokens: int, *, queued: bool
    ) -> Decision:
        return self.state.admit(tenant, request_id, limits, reserve_tokens, queued=queued)

    async def release(self, tenant: str, request_id: str, used_tokens: int) -> None:
        self.state.release(tenant, request_id, used_tokens)

    async def renew(self, tenant: str, request_id: str, limits: Limits) -> None:
        self.state.renew(tenant, request_id, limits.lease_ttl_ms)

    async def leave_queue(self, tenant: str, request_id: str) -> None:
        self.state.leave_queue(tenant, request_id)

    async def peek(self, tenant: str) -> WindowState:
        return self.state.peek(tenant)
