"""The BudgetOut a tenant or an admin reads: the live figures from the budget backend, the ledger and
events from the database."""

from decimal import Decimal

from starlette.concurrency import run_in_threadpool

from app.budgets.guard import BudgetGuard, periods_at
from app.schemas.budgets import BudgetOut, CreditEntryOut, SpendLimitOut
from billing import credit, repository
from billing.micros import from_micros


async def budget_out(guard: BudgetGuard, tenant_id: str, *, with_entries: bool) -> BudgetOut:
    view = await guard.view(tenant_id)
    assert view is not None  # view() loads the tenant first
    periods = periods_at()

    def read() -> tuple[str, bool, list[CreditEntryOut] | None, list[str]]:
        with guard.sessions() as session:
            tenant = repository.get_tenant(session, tenant_id=tenant_id)
            currency = repository.get_tier(session, name=tenant.tier).currency
            entries = None
            if with_entries:
                rows = credit.credit_entries(session, tenant_id=tenant_id)
                entries = [CreditEntryOut.model_validate(row) for row in rows]
            events = credit.events(session, tenant_id=tenant_id, period_keys=[periods.day, periods.month])
            return currency, tenant.prepaid, entries, [f"{e.period_key}: {e.detail}" for e in events]

    currency, prepaid, entries, events = await run_in_threadpool(read)
    limits = {}
    for period, (amount, hard) in view.limits.items():
        spent = view.spent_day if period == "day" else view.spent_month
        limits[period] = SpendLimitOut(
            amount=from_micros(amount), hard=hard, spent=from_micros(spent),
            remaining=from_micros(max(0, amount - spent - view.reserved)),
        )  # fmt: skip
    remaining = view.remaining()
    return BudgetOut(
        currency=currency,
        prepaid=prepaid,
        balance=None if view.balance is None else from_micros(view.balance),
        reserved=from_micros(view.reserved),
        spent_today=from_micros(view.spent_day),
        spent_this_month=from_micros(view.spent_month),
        remaining=None if remaining is None else max(Decimal(0), from_micros(remaining)),
        limits=limits,
        soft_limit_events=events,
        entries=entries,
    )
