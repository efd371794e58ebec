"""The in-cluster limiter backend: one named Ray actor holding LimiterState for the whole cluster.

Every ingress replica talks to the same actor, so limits hold across replicas with nothing outside Ray.
Calls carry a timeout: a dead or restarting actor makes the ingress answer 503 (or pass, if fail-open),
never hang. A restarted actor starts with empty windows, which errs towards admitting.
"""

import asyncio
from typing import Any

import ray

from app.limits.protocol import Decision, LimiterBackend, LimiterUnavailable, Limits, WindowState
from app.limits.state import LimiterState

ACTOR_NAME = "loraplex-rate-limiter"


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1)  # type: ignore[call-overload]
class LimiterActor:
    """Serialises every call (max_concurrency=1): each admit is atomic."""

    def __init__(self) -> None:
        self.state = LimiterState()

    def admit(self, tenant: str, request_id: str, limits: Limits, reserve: int, queued: bool) -> Decision:
        return self.state.admit(tenant, request_id, limits, reserve, queued=queued)

    def release(self, tenant: str, request_id: str, used: int) -> None:
        self.state.release(tenant, request_id, used)

    def renew(self, tenant: str, request_id: str, ttl_ms: int) -> None:
        self.state.renew(tenant, request_id, ttl_ms)

    def leave_queue(self, tenant: str, request_id: str) -> None:
        self.state.leave_queue(tenant, request_id)

    def peek(self, tenant: str) -> WindowState:
        return self.state.peek(tenant)


class RayLimiter(LimiterBackend):
    def __init__(self, *, namespace: str = "loraplex", timeout_s: float = 2.0) -> None:
        self._actor: Any = LimiterActor.options(  # type: ignore[attr-defined]
            name=ACTOR_NAME, namespace=namespace, get_if_exists=True, lifetime="detached"
        ).remote()
        self._timeout = timeout_s

    async def _call(self, ref: Any) -> Any:
        try:
            return await asyncio.wait_for(ref, self._timeout)
        except (TimeoutError, ray.exceptions.RayError) as error:
            raise LimiterUnavailable(f"rate limiter actor unavailable: {error}") from error

    async def admit(
        self, tenant: str, request_id: str, limits: Limits, reserve_tokens: int, *, queued: bool
    ) -> Decision:
        decision: Decision = await self._call(
            self._actor.admit.remote(tenant, request_id, limits, reserve_tokens, queued)
        )
        return decision

    async def release(self, tenant: str, request_id: str, used_tokens: int) -> None:
        await self._call(self._actor.release.remote(tenant, request_id, used_tokens))

    async def renew(self, tenant: str, request_id: str, limits: Limits) -> None:
        await self._call(self._actor.renew.remote(tenant, request_id, limits.lease_ttl_ms))

    async def leave_queue(self, tenant: str, request_id: str) -> None:
        await self._call(self._actor.leave_queue.remote(tenant, request_id))

    async def peek(self, tenant: str) -> WindowState:
        state: WindowState = await self._call(self._actor.peek.remote(tenant))
        return state
