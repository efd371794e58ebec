"""The in-cluster limiter backend: one named Ray actor holding WaitingState for the whole cluster.

Every ingress replica talks to the same actor, so limits hold across replicas with nothing outside Ray.
The actor is async with a high max_concurrency: a queued admit waits inside the actor (an await, not a
loop of calls from the ingress), and thousands of waiting or checking callers never queue behind each
other; each check runs between awaits on the actor's one event loop, so it stays atomic. Calls carry a
timeout (a waiting admit's is its wait plus that): a dead or restarting actor makes the ingress answer 503
(or pass, if fail-open), never hang. A restarted actor starts with empty windows, which errs towards
admitting.
"""

import asyncio
import contextlib
from typing import Any

import ray

from app.limits.protocol import (
    DEFAULT_MAX_WAITERS,
    Decision,
    LimiterBackend,
    LimiterUnavailable,
    Limits,
    WindowState,
    check_sequences,
    check_tokens,
    check_wait,
)
from app.limits.waiting_state import WaitingState

ACTOR_NAME = "loraplex-rate-limiter"
ACTOR_CONCURRENCY = 10_000  # callers in flight at once: every waiter of every tenant, and then some


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=ACTOR_CONCURRENCY)  # type: ignore[call-overload]
class LimiterActor:
    def __init__(self, max_waiters: int) -> None:
        self.state = WaitingState(max_waiters)

    async def admit(
        self, tenant: str, request_id: str, limits: Limits, reserve: int, wait_ms: int, sequences: int = 1
    ) -> Decision:
        return await self.state.admit(
            tenant, request_id, limits, reserve, wait_ms=wait_ms, sequences=sequences
        )

    async def release(self, tenant: str, request_id: str, used: int) -> None:
        self.state.release(tenant, request_id, used)

    async def renew(self, tenant: str, request_id: str, ttl_ms: int) -> None:
        self.state.renew(tenant, request_id, ttl_ms)

    async def deliver(self, tenant: str, request_id: str) -> None:
        self.state.deliver(tenant, request_id)

    async def leave_queue(self, tenant: str, request_id: str) -> None:
        self.state.leave_queue(tenant, request_id)

    async def peek(self, tenant: str) -> WindowState:
        return self.state.peek(tenant)


class RayLimiter(LimiterBackend):
    def __init__(
        self,
        *,
        namespace: str = "loraplex",
        timeout_s: float = 10.0,
        max_waiters_per_tenant: int = DEFAULT_MAX_WAITERS,
    ) -> None:
        self._actor: Any = LimiterActor.options(  # type: ignore[attr-defined]
            name=ACTOR_NAME, namespace=namespace, get_if_exists=True, lifetime="detached"
        ).remote(max_waiters_per_tenant)
        self._timeout = timeout_s

    async def _call(self, ref: Any, extra_s: float = 0.0) -> Any:
        try:
            return await asyncio.wait_for(ref, self._timeout + extra_s)
        except (TimeoutError, ray.exceptions.RayError) as error:
            _cancel(ref)  # never admit, later, a call its caller has given up on
            raise LimiterUnavailable(f"rate limiter actor unavailable: {error}") from error
        except asyncio.CancelledError:
            _cancel(ref)  # the caller left: stop the actor-side wait too (leave_queue follows)
            raise

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
        reserve, wait = check_tokens("reserve_tokens", reserve_tokens), check_wait(wait_ms)
        ref = self._actor.admit.remote(tenant, request_id, limits, reserve, wait, check_sequences(sequences))
        decision: Decision = await self._call(ref, wait / 1000)
        return decision

    async def release(self, tenant: str, request_id: str, used_tokens: int) -> None:
        used = check_tokens("used_tokens", used_tokens)
        await self._call(self._actor.release.remote(tenant, request_id, used))

    async def renew(self, tenant: str, request_id: str, limits: Limits) -> None:
        await self._call(self._actor.renew.remote(tenant, request_id, limits.lease_ttl_ms))

    async def deliver(self, tenant: str, request_id: str) -> None:
        await self._call(self._actor.deliver.remote(tenant, request_id))

    async def leave_queue(self, tenant: str, request_id: str) -> None:
        await self._call(self._actor.leave_queue.remote(tenant, request_id))

    async def peek(self, tenant: str) -> WindowState:
        state: WindowState = await self._call(self._actor.peek.remote(tenant))
        return state


def _cancel(ref: Any) -> None:
    with contextlib.suppress(Exception):  # already finished, or the actor is gone: nothing waits there
        ray.cancel(ref)
