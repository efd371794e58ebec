"""Spend reconciliation (issue 29): for each tenant and UTC day, the spend settled into its usage rows
(each row's cost, fixed at settlement) against the same rows priced afresh from the price book at the
moment each started, to the cent; and any row left without a cost.

Settled costs use the prices a request was admitted at (cached for a few seconds), so a price change lands
on requests at most that long late; anything else that makes the two disagree (a lost settlement, a
rewritten price row, an unpriced row) is a discrepancy.
"""

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.models import UsageEvent
from billing.price_book import PriceHistory
from billing.pricing import ZERO

CENT = Decimal("0.01")


@dataclass(frozen=True)
class SpendDiscrepancy:
    tenant_id: str
    day: str  # YYYY-MM-DD (UTC)
    settled: Decimal  # the usage rows' costs
    repriced: Decimal  # the same rows at the price book's prices
    unpriced: int  # rows without a cost

    def as_dict(self) -> dict[str, Any]:
        return {"tenant_id": self.tenant_id, "day": self.day, "settled": str(self.settled),
                "repriced": str(self.repriced), "unpriced": self.unpriced}  # fmt: skip


def reconcile_spend(session: Session, *, start: datetime, end: datetime) -> list[SpendDiscrepancy]:
    """Every tenant and UTC day in [start, end) whose settled spend and repriced spend differ by a cent
    or more, or that has unpriced rows."""
    history = PriceHistory(session)
    settled: defaultdict[tuple[str, str], Decimal] = defaultdict(lambda: ZERO)
    repriced: defaultdict[tuple[str, str], Decimal] = defaultdict(lambda: ZERO)
    unpriced: defaultdict[tuple[str, str], int] = defaultdict(int)
    events = session.scalars(
        select(UsageEvent).where(UsageEvent.started_at >= start, UsageEvent.started_at < end)
    )
    for event in events:
        key = (event.tenant_id, event.started_at.strftime("%Y-%m-%d"))
        due = history.cost(event)
        if due is None:
            unpriced[key] += 1
            continue
        # A row settled without a cost (its ingress could not price it: the database down at admission, a
        # request that failed before its usage was known) is billed from the price history; nothing to
        # disagree with. Only a row no price covers is unpriced.
        settled[key] += due if event.cost is None else Decimal(str(event.cost))
        repriced[key] += due
    found = []
    for key in sorted(set(settled) | set(unpriced)):
        a, b = settled[key], repriced[key]
        if unpriced[key] or abs(a - b) >= CENT:
            found.append(SpendDiscrepancy(key[0], key[1], a, b, unpriced[key]))
    return found
