"""LocalBudgets: BudgetState in this process, right for one ingress replica (tests, single-process tools);
several ingress replicas share the Ray actor or Redis instead."""

from app.budgets.protocol import BudgetBackend, BudgetView, Hold, Periods
from app.budgets.state import BudgetState
from billing.credit import BudgetSnapshot


class LocalBudgets(BudgetBackend):
    def __init__(self) -> None:
        self.state = BudgetState()

    async def load(self, snapshot: BudgetSnapshot, version: int) -> bool:
        return self.state.load(snapshot, version)

    async def reserve(self, tenant: str, request_id: str, amount: int, ttl_ms: int, periods: Periods) -> Hold:
        return self.state.reserve(tenant, request_id, amount, ttl_ms, periods)

    async def settle(self, tenant: str, request_id: str, cost: int, periods: Periods) -> None:
        self.state.settle(tenant, request_id, cost, periods)

    async def renew(self, tenant: str, request_id: str, ttl_ms: int) -> None:
        self.state.renew(tenant, request_id, ttl_ms)

    async def credit(self, tenant: str, delta: int, version: int) -> None:
        self.state.credit(tenant, delta, version)

    async def set_limits(self, tenant: str, limits: dict[str, tuple[int, bool]]) -> None:
        self.state.set_limits(tenant, limits)

    async def forget(self, tenant: str) -> None:
        self.state.forget(tenant)

    async def peek(self, tenant: str, periods: Periods) -> BudgetView | None:
        return self.state.peek(tenant, periods)
