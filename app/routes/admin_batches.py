"""Admin API for the Batch API (issue 37, item 6): every tenant's batches, newest first, and cancelling one
as its tenant would (queued lines never run; running ones finish, then `cancelled`)."""

from typing import Annotated, Any

from fastapi import APIRouter, Query
from starlette.concurrency import run_in_threadpool

from app.batches.store import BatchStore
from app.deps import AdminDep, ServicesDep
from app.errors import NotFound
from app.route_guards import AdminRoute

router = APIRouter(prefix="/admin", tags=["admin"], route_class=AdminRoute)


@router.get("/batches")
async def list_batches(
    _: AdminDep,
    services: ServicesDep,
    tenant_id: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> dict[str, Any]:
    """The newest batches, of one tenant or of all, each with its tenant_id."""
    store = BatchStore(services.session_factory)
    data = await run_in_threadpool(lambda: store.every_tenant(tenant_id, limit=limit))
    return {"object": "list", "data": data}


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, _: AdminDep, services: ServicesDep) -> dict[str, Any]:
    store = BatchStore(services.session_factory)
    tenant_id = await run_in_threadpool(store.tenant_of, batch_id)
    found = None if tenant_id is None else await run_in_threadpool(store.cancel, tenant_id, batch_id)
    if found is None or tenant_id is None:
        raise NotFound(f"No such Batch object: {batch_id[:64]}")
    return {**found, "tenant_id": tenant_id}
