"""GET /admin/engines: tenant isolation inside each engine replica (service per tenant, who waits and for
how long, preemptions by reason, adapter queues, resident ranks), from what the replicas report to the
billing database every few seconds. A replica that stopped reporting drops out after `within_s`."""

from fastapi import APIRouter

from app.deps import AdminDep, ServicesDep
from app.route_guards import AdminRoute
from app.routes.routing import ReportScopeDep
from app.schemas.engines import EngineList, ReplicaIsolationOut
from billing.isolation_report import isolation_report

router = APIRouter(prefix="/admin", tags=["admin"], route_class=AdminRoute)


@router.get("/engines")
def admin_engines(_: AdminDep, services: ServicesDep, scope: ReportScopeDep) -> EngineList:
    with services.session_factory() as session:
        replicas = isolation_report(session, base_model=scope.model, within=scope.within)
    return EngineList(data=[ReplicaIsolationOut.model_validate(r) for r in replicas])
