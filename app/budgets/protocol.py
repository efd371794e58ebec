"""Budgets as the ingress sees them: the backend that holds reservations against a tenant's money, and
what it answers.

Amounts are integer micro-units (billing.micros), never floats. A tenant's budget is loaded from the
database (billing.credit.BudgetSnapshot) into the backend, which then keeps it current itself: a
reservation holds the worst case of a request until it settles to its metered cost (or expires, for a
request whose replica died), top-ups land as deltas, and a new UTC day or month starts its spend at zero.
A backend that has lost its state (a restart) answers `not_loaded`, and the ingress loads the tenant again
from the database before admitting anything: budgets fail closed.
"""

from dataclasses import dataclass, field
from typing import Literal, Protocol

from billing.credit import BudgetSnapshot

# credit: the prepaid balance; day / month: a hard spend limit; not_loaded: the backend must be loaded.
BudgetReason = Literal["credit", "day", "month", "not_loaded"]
SETTLED_MEMORY_MS = 600_000  # a settled id is remembered this long: a retried settle charges once
# A credit notice for a tenant not loaded is remembered this long (its version only): a load whose
# snapshot was read before that entry and installs after the notice would otherwise miss it.
UNSEEN_CREDIT_MS = 60_000


@dataclass(frozen=True)
class Periods:
    """The current UTC period keys ("day:2026-11-27", "month:2026-11"), from the ingress's clock."""

    day: str
    month: str


@dataclass(frozen=True)
class BudgetView:
    """A tenant's budget at one moment, in micro-units; None where it has no such thing."""

    balance: int | None  # prepaid credit left, before reservations
    reserved: int  # held by requests in flight
    spent_day: int
    spent_month: int
    limits: dict[str, tuple[int, bool]] = field(default_factory=dict)  # period -> (amount, hard)

    def remaining(self) -> int | None:
        """What a new reservation may still take: the least of the credit and the hard limits' room."""
        rooms = [] if self.balance is None else [self.balance - self.reserved]
        for period, (amount, hard) in self.limits.items():
            if hard:
                spent = self.spent_day if period == "day" else self.spent_month
                rooms.append(amount - spent - self.reserved)
        return min(rooms) if rooms else None

    def soft_over(self) -> list[str]:
        """The periods whose soft limit the spend (with what is reserved) has passed."""
        over = []
        for period, (amount, hard) in self.limits.items():
            spent = self.spent_day if period == "day" else self.spent_month
            if not hard and spent + self.reserved > amount:
                over.append(period)
        return over


@dataclass(frozen=True)
class Hold:
    """A reservation's answer: admitted, or the limit it would break; with the budget after it."""

    admitted: bool
    reason: BudgetReason | None
    view: BudgetView | None  # None when not loaded


class BudgetBackend(Protocol):
    """Shared budget state for every ingress replica; each call is atomic. Failures raise
    LimiterUnavailable (app.limits), and the ingress then refuses (budgets fail closed)."""

    async def load(self, snapshot: BudgetSnapshot, version: int) -> bool:
        """Take the tenant's budget from the database, unless it is loaded already (a live state is newer
        than any snapshot: it has settlements the database may not have yet). `version`: how many credit
        entries the snapshot saw. False when a credit notice newer than the snapshot came while the
        tenant was not loaded (within UNSEEN_CREDIT_MS): the snapshot is stale, nothing was taken, and
        the caller reads a new one."""
        ...

    async def reserve(self, tenant: str, request_id: str, amount: int, ttl_ms: int, periods: Periods) -> Hold:
        """Hold `amount` for the request until it settles or the hold expires (`ttl_ms`, renewable)."""
        ...

    async def settle(self, tenant: str, request_id: str, cost: int, periods: Periods) -> None:
        """The request ended and cost this: spend it, release the rest of its hold. Idempotent per id; a
        request whose hold expired is still charged."""
        ...

    async def renew(self, tenant: str, request_id: str, ttl_ms: int) -> None:
        """Push the hold's expiry back (long streams)."""
        ...

    async def credit(self, tenant: str, delta: int, version: int) -> None:
        """A credit entry landed in the database: add it to a loaded balance exactly once, in whatever
        order notices arrive (they come from different replicas). `version` is the entry's place in the
        tenant's ledger (billing.credit.add_credit allocates them one by one under the tenant's lock):
        entries the snapshot already counted, `version` <= its own, are skipped, and so is one counted
        already because it arrived before an earlier one. A notice for a tenant not loaded (or loaded
        as postpaid, which it drops) leaves its version behind, so a load in flight with an older
        snapshot is refused rather than losing the entry."""
        ...

    async def set_limits(self, tenant: str, limits: dict[str, tuple[int, bool]]) -> None:
        """New spend limits (spend so far is kept)."""
        ...

    async def forget(self, tenant: str) -> None:
        """Drop the tenant's state: it is loaded again from the database on its next request."""
        ...

    async def peek(self, tenant: str, periods: Periods) -> BudgetView | None:
        """The tenant's budget without changing anything; None when not loaded."""
        ...
