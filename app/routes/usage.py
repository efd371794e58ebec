"""Usage and bills: GET /v1/usage (a tenant's own usage and storage), GET /admin/usage (any tenant's,
or all) and GET /admin/tenants/{id}/bill.

Usage is live (aggregated from the usage events as they are recorded); a bill is made of hourly rollups
(billing.pricing). Database work is synchronous, so these are plain `def` routes run in the thread pool.
"""

from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query

from app.deps import AdminDep, ReaderDep, ServicesDep
from app.errors import InvalidParameter, NotFound
from app.responses.store import ResponseStore
from app.route_guards import AdminRoute, TenantRoute
from app.schemas.usage import BillOut, StorageOut, UsageList, UsageRowOut
from app.storage import stored_bytes
from billing import pricing, repository
from billing.errors import TenantNotFound
from billing.usage_queries import GroupBy, usage

MAX_USAGE_SPAN = timedelta(days=93)

router = APIRouter(prefix="/v1", tags=["usage"], route_class=TenantRoute)
admin_router = APIRouter(prefix="/admin", tags=["admin"], route_class=AdminRoute)

Start = Annotated[
    datetime, Query(description="Start of the period (ISO 8601, inclusive); without an offset: UTC.")
]
End = Annotated[datetime, Query(description="End of the period (ISO 8601, exclusive); after start.")]
GroupByQuery = Annotated[
    GroupBy,
    Query(description="hour, adapter (within base model), model, or batch (interactive: batch_id null)."),
]


def _utc(moment: datetime, param: str) -> datetime:
    """In UTC (naive: already UTC); 400 naming `param` when its offset moves it past year 1 or 9999."""
    try:
        return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    except OverflowError:
        raise InvalidParameter(f"{param} is out of range once converted to UTC", param=param) from None


def usage_period(start: datetime, end: datetime) -> tuple[datetime, datetime]:
    """(start, end) in UTC; 400 naming `end` unless start < end <= start + 93 days."""
    start, end = _utc(start, "start"), _utc(end, "end")
    if end <= start:
        raise InvalidParameter("end must be after start", param="end")
    if end - start > MAX_USAGE_SPAN:
        raise InvalidParameter(f"the period may span at most {MAX_USAGE_SPAN.days} days", param="end")
    return start, end


@router.get("/usage")
def tenant_usage(
    principal: ReaderDep, services: ServicesDep, start: Start, end: End, group_by: GroupByQuery = "hour"
) -> UsageList:
    """The calling tenant's own usage in [start, end), live: requests and tokens as soon as they are
    recorded, and the bytes its stored responses and files take now against its tier's quota. Never another
    tenant's: the tenant comes from the API key alone."""
    start, end = usage_period(start, end)
    with services.session_factory() as session:
        rows = usage(session, tenant_id=principal.tenant_id, start=start, end=end, group_by=group_by)
    data = [UsageRowOut.model_validate(row) for row in rows]
    responses = ResponseStore(services.session_factory, services.settings.responses)
    stored = stored_bytes(responses, services.file_store(), principal.tenant_id)
    storage = StorageOut(
        stored_response_bytes=stored.responses,
        file_bytes=stored.files,
        max_stored_response_bytes=principal.max_stored_response_bytes,
    )
    return UsageList(start=start, end=end, group_by=group_by, data=data, storage=storage)


@admin_router.get("/usage")
def admin_usage(
    _: AdminDep,
    services: ServicesDep,
    start: Start,
    end: End,
    group_by: GroupByQuery = "hour",
    tenant_id: Annotated[str | None, Query(description="One tenant; default: all, by tenant.")] = None,
) -> UsageList:
    """Usage in [start, end) of one tenant or of every tenant (each row names its tenant)."""
    start, end = usage_period(start, end)
    with services.session_factory() as session:
        if tenant_id is not None:
            try:
                repository.get_tenant(session, tenant_id=tenant_id)
            except TenantNotFound as error:
                raise NotFound(str(error), param="tenant_id") from None
        rows = usage(session, tenant_id=tenant_id, start=start, end=end, group_by=group_by)
    data = [UsageRowOut.model_validate(row) for row in rows]
    return UsageList(start=start, end=end, group_by=group_by, data=data)


@admin_router.get("/tenants/{tenant_id}/bill")
def tenant_bill(
    tenant_id: str,
    _: AdminDep,
    services: ServicesDep,
    start: Annotated[datetime, Query(description="First hour billed (a whole UTC hour, inclusive).")],
    end: Annotated[datetime, Query(description="End of the period (a whole UTC hour, exclusive).")],
) -> BillOut:
    """The tenant's bill for the rolled-up hours in [start, end), at the costs settled for them (what the
    Stripe cost meter was sent: a later price change does not reprice it); amounts are decimal strings with
    6 decimals. Hours not rolled up yet (the current one) are not in it. A period whose usage was settled
    in two currencies is a 400 naming `end`."""
    start, end = _utc(start, "start"), _utc(end, "end")
    try:
        with services.session_factory() as session:
            return BillOut.model_validate(pricing.bill(session, tenant_id=tenant_id, start=start, end=end))
    except pricing.InvalidPeriod as error:
        raise InvalidParameter(str(error), param=error.param) from None
