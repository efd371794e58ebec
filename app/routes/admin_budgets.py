"""Admin API for money (issue 29): a tenant's prepaid credit (an append-only ledger) and spend limits.

Each change is written to the database first (the truth), then told to the shared budget backend: a
top-up as a versioned delta (counted once, in whatever order notices arrive), new limits as they are. A
backend that cannot be told loads the tenant afresh later; until then it errs towards refusing.
"""

import logging

from fastapi import APIRouter, Request, status
from starlette.concurrency import run_in_threadpool

from app.budgets.view import budget_out
from app.deps import AdminDep, ServicesDep
from app.errors import InvalidParameter
from app.middleware import request_id_of
from app.route_guards import AdminRoute
from app.schemas.budgets import BudgetOut, BudgetsSet, CreditCreate, CreditEntryOut
from app.surfaces import surface_of
from billing import credit
from billing.micros import to_micros

log = logging.getLogger(__name__)
router = APIRouter(prefix="/admin", tags=["admin"], route_class=AdminRoute)


@router.post("/tenants/{tenant_id}/credit", status_code=status.HTTP_201_CREATED)
async def add_credit(
    tenant_id: str, body: CreditCreate, request: Request, _: AdminDep, services: ServicesDep
) -> CreditEntryOut:
    """Append a top-up or adjustment to the tenant's credit ledger. The first credit granted makes the
    tenant prepaid from that hour on (earlier usage stays invoiced); a postpaid tenant cannot be adjusted
    below zero (400 tenant_not_prepaid). The entry records the request's id and surface beside the
    `actor` the body names."""
    request_id = request_id_of(request.scope["state"])
    surface = surface_of(request.headers.get("user-agent", ""))

    def write() -> tuple[CreditEntryOut, int]:
        with services.session_factory() as session, session.begin():
            try:
                entry = credit.add_credit(session, tenant_id=tenant_id, amount=body.amount, kind=body.kind,
                                          reason=body.reason, actor=body.actor, request_id=request_id,
                                          surface=surface)  # fmt: skip
            except credit.InvalidAmount as error:
                raise InvalidParameter(str(error), param="amount", code=error.code) from None
            return CreditEntryOut.model_validate(entry), credit.credit_version(session, tenant_id=tenant_id)

    entry, version = await run_in_threadpool(write)
    guard = services.budget_guard
    if guard is not None:
        try:
            await guard.backend.credit(tenant_id, to_micros(entry.amount), version)
        except Exception:  # the backend is away: its state is gone or stale, and it reloads or refuses
            log.exception("telling the budget backend about %s's credit failed", tenant_id)
    return entry


@router.get("/tenants/{tenant_id}/credit")
async def show_credit(tenant_id: str, _: AdminDep, services: ServicesDep) -> BudgetOut:
    """The tenant's balance, spend, reservations, limits and its whole credit ledger."""
    guard = services.budget_guard
    assert guard is not None
    await run_in_threadpool(_exists, services, tenant_id)
    return await budget_out(guard, tenant_id, with_entries=True)


@router.put("/tenants/{tenant_id}/budgets")
async def set_budgets(tenant_id: str, body: BudgetsSet, _: AdminDep, services: ServicesDep) -> BudgetOut:
    """Replace the tenant's spend limits (day, month; hard or soft); a period left out has none."""

    def write() -> dict[str, tuple[int, bool]]:
        with services.session_factory() as session, session.begin():
            limits = {}
            for period in ("day", "month"):
                given = getattr(body, period)
                try:
                    credit.set_spend_limit(session, tenant_id=tenant_id, period=period,
                                           amount=None if given is None else given.amount,
                                           hard=True if given is None else given.hard)  # fmt: skip
                except credit.InvalidAmount as error:
                    raise InvalidParameter(
                        str(error), param=f"{period}.amount", code="invalid_amount"
                    ) from None
                if given is not None:
                    limits[period] = (to_micros(given.amount), given.hard)
            return limits

    limits = await run_in_threadpool(write)
    guard = services.budget_guard
    assert guard is not None
    try:
        await guard.backend.set_limits(tenant_id, limits)
    except Exception:
        log.exception("telling the budget backend about %s's limits failed", tenant_id)
    return await budget_out(guard, tenant_id, with_entries=False)


def _exists(services: ServicesDep, tenant_id: str) -> None:
    from billing import repository

    with services.session_factory() as session:
        repository.get_tenant(session, tenant_id=tenant_id)
