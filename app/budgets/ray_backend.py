"""RayBudgets: BudgetState in one named, detached Ray actor, shared by every ingress replica of the
cluster (the embedded default, beside the rate limiter's actor). Each call runs whole on the actor's one
event loop, so it is atomic. A restarted actor starts empty, so every tenant answers `not_loaded` and is
loaded again from the database before anything is admitted: it fails closed, never open."""

import asyncio
import contextlib
from typing import Any

import ray

from app.budgets.local_backend import LocalBudgets
from app.budgets.protocol import BudgetBackend, BudgetView, Hold, Periods
from app.limits import LimiterUnavailable
from billing.credit import BudgetSnapshot

ACTOR_NAME = "loraplex-budgets"


# The actor is LocalBudgets itself: the same BudgetState calls, run on the actor's one event loop.
BudgetActor: Any = ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1000)(  # type: ignore[call-overload]
    LocalBudgets
)


class RayBudgets(BudgetBackend):
    def __init__(self, *, namespace: str = "loraplex", timeout_s: float = 10.0) -> None:
        self._actor: Any = BudgetActor.options(
            name=ACTOR_NAME, namespace=namespace, get_if_exists=True, lifetime="detached"
        ).remote()
        self._timeout = timeout_s

    async def _call(self, ref: Any) -> Any:
        try:
            return await asyncio.wait_for(ref, self._timeout)
        except (TimeoutError, ray.exceptions.RayError) as error:
            with contextlib.suppress(Exception):
                ray.cancel(ref)
            raise LimiterUnavailable(f"budget actor unavailable: {error}") from error

    async def load(self, snapshot: BudgetSnapshot, version: int) -> bool:
        return bool(await self._call(self._actor.load.remote(snapshot, version)))

    async def reserve(self, tenant: str, request_id: str, amount: int, ttl_ms: int, periods: Periods) -> Hold:
        hold: Hold = await self._call(self._actor.reserve.remote(tenant, request_id, amount, ttl_ms, periods))
        return hold

    async def settle(self, tenant: str, request_id: str, cost: int, periods: Periods) -> None:
        await self._call(self._actor.settle.remote(tenant, request_id, cost, periods))

    async def renew(self, tenant: str, request_id: str, ttl_ms: int) -> None:
        await self._call(self._actor.renew.remote(tenant, request_id, ttl_ms))

    async def credit(self, tenant: str, delta: int, version: int) -> None:
        await self._call(self._actor.credit.remote(tenant, delta, version))

    async def set_limits(self, tenant: str, limits: dict[str, tuple[int, bool]]) -> None:
        await self._call(self._actor.set_limits.remote(tenant, limits))

    async def forget(self, tenant: str) -> None:
        await self._call(self._actor.forget.remote(tenant))

    async def peek(self, tenant: str, periods: Periods) -> BudgetView | None:
        view: BudgetView | None = await self._call(self._actor.peek.remote(tenant, periods))
        return view
