"""BudgetState: the budget algorithm on in-memory state. The local backend and the Ray actor hold one;
the Redis backend runs the same steps as Lua scripts (redis_backend.py), and tests/budgets holds all three
to the same behaviour.

Per tenant: the balance (None: not prepaid), the spend of the current day and month (a reservation or
settlement that names a newer period starts that period at zero), the hard and soft limits, the holds in
flight (id -> amount, expiry) with their total, the ids settled lately (so a retried settle charges
once), and the credit entries counted: every version up to `version`, and those above it that arrived
before an earlier one (notices from different replicas race), so each entry lands exactly once in any order.
A notice for a tenant not loaded leaves its version for a while (`unseen`), and a load whose snapshot
predates it is refused: the loader reads the database again, which by then has the entry.
"""

import time
from dataclasses import dataclass, field

from app.budgets.protocol import SETTLED_MEMORY_MS, UNSEEN_CREDIT_MS, BudgetView, Hold, Periods
from billing.credit import BudgetSnapshot


@dataclass
class _Tenant:
    balance: int | None
    version: int
    day: str
    month: str
    spent_day: int
    spent_month: int
    limits: dict[str, tuple[int, bool]]
    holds: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (amount, expiry ms)
    reserved: int = 0
    settled: dict[str, int] = field(default_factory=dict)  # id -> forget after (ms)
    credits: set[int] = field(default_factory=set)  # entries counted past `version` (arrived early)


class BudgetState:
    def __init__(self) -> None:
        self._tenants: dict[str, _Tenant] = {}
        # A tenant not loaded -> (the newest credit version noticed for it, until when in ms).
        self._unseen: dict[str, tuple[int, int]] = {}

    @staticmethod
    def now_ms() -> int:
        return time.monotonic_ns() // 1_000_000

    def load(self, snapshot: BudgetSnapshot, version: int, now: int | None = None) -> bool:
        if snapshot.tenant_id in self._tenants:
            return True
        unseen = self._unseen.pop(snapshot.tenant_id, None)
        if unseen is not None and unseen[0] > version and unseen[1] > (self.now_ms() if now is None else now):
            self._unseen[snapshot.tenant_id] = unseen  # kept for the next try, which must be as new
            return False
        self._tenants[snapshot.tenant_id] = _Tenant(
            balance=snapshot.balance,
            version=version,
            day=snapshot.day_key,
            month=snapshot.month_key,
            spent_day=snapshot.spent_day,
            spent_month=snapshot.spent_month,
            limits=dict(snapshot.limits),
        )
        return True

    def reserve(
        self, tenant: str, request_id: str, amount: int, ttl_ms: int, periods: Periods, now: int | None = None
    ) -> Hold:
        if amount < 0:
            raise ValueError(f"a reservation must not be negative, got {amount}")
        t = self._tenants.get(tenant)
        if t is None:
            return Hold(False, "not_loaded", None)
        now = self.now_ms() if now is None else now
        self._expire(t, now)
        self._roll(t, periods)
        previous = t.holds.get(request_id)
        held = t.reserved - (previous[0] if previous else 0)  # the same id again replaces its hold
        view = self._view(t, held)
        if view.balance is not None and view.balance - held - amount < 0:
            return Hold(False, "credit", self._view(t))
        for period in ("day", "month"):
            limit = t.limits.get(period)
            spent = t.spent_day if period == "day" else t.spent_month
            if limit is not None and limit[1] and limit[0] - spent - held - amount < 0:
                return Hold(False, period, self._view(t))
        t.holds[request_id] = (amount, now + ttl_ms)
        t.reserved = held + amount
        return Hold(True, None, self._view(t))

    def settle(
        self, tenant: str, request_id: str, cost: int, periods: Periods, now: int | None = None
    ) -> None:
        if cost < 0:
            raise ValueError(f"a cost must not be negative, got {cost}")
        t = self._tenants.get(tenant)
        if t is None:  # not loaded: the usage row carries the cost to the next load
            return
        now = self.now_ms() if now is None else now
        for gone in [i for i, until in t.settled.items() if until <= now]:
            del t.settled[gone]
        if request_id in t.settled:
            return
        self._roll(t, periods)
        hold = t.holds.pop(request_id, None)
        if hold is not None:
            t.reserved -= hold[0]
        if t.balance is not None:
            t.balance -= cost
        t.spent_day += cost
        t.spent_month += cost
        t.settled[request_id] = now + SETTLED_MEMORY_MS

    def renew(self, tenant: str, request_id: str, ttl_ms: int, now: int | None = None) -> None:
        t = self._tenants.get(tenant)
        if t is not None and request_id in t.holds:
            amount, _ = t.holds[request_id]
            t.holds[request_id] = (amount, (self.now_ms() if now is None else now) + ttl_ms)

    def credit(self, tenant: str, delta: int, version: int, now: int | None = None) -> None:
        t = self._tenants.get(tenant)
        if t is None or t.balance is None:
            # Not loaded, or it just became prepaid (its balance is the database's to say): a load with
            # an older snapshot must not install it.
            self._tenants.pop(tenant, None)
            self._remember_unseen(tenant, version, self.now_ms() if now is None else now)
            return
        if version <= t.version or version in t.credits:
            return
        t.balance += delta
        t.credits.add(version)
        while t.version + 1 in t.credits:  # every entry up to here is counted now
            t.version += 1
            t.credits.remove(t.version)

    def _remember_unseen(self, tenant: str, version: int, now: int) -> None:
        for lapsed in [name for name, (_, until) in self._unseen.items() if until <= now]:
            del self._unseen[lapsed]
        newest = max(version, self._unseen.get(tenant, (0, 0))[0])
        self._unseen[tenant] = (newest, now + UNSEEN_CREDIT_MS)

    def set_limits(self, tenant: str, limits: dict[str, tuple[int, bool]]) -> None:
        t = self._tenants.get(tenant)
        if t is not None:
            t.limits = dict(limits)

    def forget(self, tenant: str) -> None:
        self._tenants.pop(tenant, None)

    def peek(self, tenant: str, periods: Periods, now: int | None = None) -> BudgetView | None:
        """What _expire and _roll would leave, computed without changing anything."""
        t = self._tenants.get(tenant)
        if t is None:
            return None
        now = self.now_ms() if now is None else now
        reserved = sum(amount for amount, expiry in t.holds.values() if expiry > now)
        return BudgetView(
            balance=t.balance,
            reserved=reserved,
            spent_day=t.spent_day if t.day == periods.day else 0,
            spent_month=t.spent_month if t.month == periods.month else 0,
            limits=dict(t.limits),
        )

    @staticmethod
    def _expire(t: _Tenant, now: int) -> None:
        for lapsed in [i for i, (_, expiry) in t.holds.items() if expiry <= now]:
            t.reserved -= t.holds.pop(lapsed)[0]

    @staticmethod
    def _roll(t: _Tenant, periods: Periods) -> None:
        """A period key later than the one held starts that period's spend at zero (keys sort by time)."""
        if periods.day > t.day:
            t.day, t.spent_day = periods.day, 0
        if periods.month > t.month:
            t.month, t.spent_month = periods.month, 0

    @staticmethod
    def _view(t: _Tenant, reserved: int | None = None) -> BudgetView:
        return BudgetView(
            balance=t.balance,
            reserved=t.reserved if reserved is None else reserved,
            spent_day=t.spent_day,
            spent_month=t.spent_month,
            limits=dict(t.limits),
        )
