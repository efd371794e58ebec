"""GET /admin/routing: routing quality per base model and replica (adapter hit rate, loads, duplicate
loads), from the counters engine replicas report to the billing database. Counters are cumulative over a
replica's life; a replica that stopped reporting drops out after `within_s`."""

from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Depends, Query

from app.deps import AdminDep, ServicesDep
from app.route_guards import AdminRoute
from app.schemas.routing import ModelRoutingOut, RoutingList
from billing.routing_report import routing_report

router = APIRouter(prefix="/admin", tags=["admin"], route_class=AdminRoute)
# Longer than any replica lives; bounded so that `now - within_s` stays a datetime (no OverflowError).
MAX_WITHIN_S = 10 * 365 * 24 * 3600.0


@dataclass(frozen=True, slots=True)
class ReportScope:
    """Which replicas' reports an admin report reads: one base model or all, reported within a window."""

    model: str | None
    within: timedelta | None


def report_scope(
    model: Annotated[str | None, Query(description="One base model; default: all.")] = None,
    within_s: Annotated[
        float | None,
        Query(gt=0, le=MAX_WITHIN_S, description="Only replicas that reported in the last within_s seconds."),
    ] = None,
) -> ReportScope:
    return ReportScope(model, timedelta(seconds=within_s) if within_s is not None else None)


ReportScopeDep = Annotated[ReportScope, Depends(report_scope)]


@router.get("/routing")
def admin_routing(_: AdminDep, services: ServicesDep, scope: ReportScopeDep) -> RoutingList:
    with services.session_factory() as session:
        models = routing_report(session, base_model=scope.model, within=scope.within)
    return RoutingList(data=[ModelRoutingOut.model_validate(m) for m in models])
