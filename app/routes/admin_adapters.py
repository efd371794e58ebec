"""Admin API for adapters: upload (validated before anything is served), list, get, pin, delete."""

from fastapi import APIRouter, Request, status
from starlette.concurrency import run_in_threadpool

from app.adapter_ingest import FILE_FIELDS, AdapterIngest
from app.deps import AdminDep, ServicesDep
from app.route_guards import AdminRoute
from app.schemas.adapters import AdapterList, AdapterOut, AdapterPatch, AdapterVersionOut
from app.services import Services
from app.upload import UPLOADS_DIR, receive_upload
from billing import adapter_registry
from billing.adapter_registry import PUBLIC_PREFIX, LiveAdapter
from billing.models import PUBLIC_OWNER

router = APIRouter(prefix="/admin/adapters", tags=["admin"], route_class=AdminRoute)


def adapter_out(live: LiveAdapter, *, versions: list[AdapterVersionOut] | None = None) -> AdapterOut:
    a, v = live.adapter, live.latest
    return AdapterOut(
        id=a.id,
        name=a.name,
        owner=a.owner,
        base_model=a.base_model,
        version=v.version,
        status="deleted" if a.deleted_at else "ready",
        rank=v.rank,
        target_modules=v.target_modules,
        sha256=v.sha256,
        size_bytes=v.size_bytes,
        pinned=a.pinned,
        model=PUBLIC_PREFIX + a.name if a.owner == PUBLIC_OWNER else a.name,
        created_at=a.created_at,
        updated_at=a.updated_at,
        deleted_at=a.deleted_at,
        versions=versions,
    )


@router.post("", status_code=status.HTTP_201_CREATED)
async def upload_adapter(request: Request, _: AdminDep, services: ServicesDep) -> AdapterOut:
    """multipart/form-data: `name`, `owner` (tenant id or "public"), `base_model` (optional when one is
    served), and either `file` (.tar.gz/.tgz/.zip of a PEFT adapter dir) or `adapter_config` plus
    `adapter_model`. Uploading an existing name for the same owner adds a version."""
    settings = services.settings
    upload = await receive_upload(
        request,
        tmp_root=settings.data_dir / UPLOADS_DIR,
        max_bytes=settings.max_upload_mb * 2**20,
        allowed_file_fields=FILE_FIELDS,
    )
    try:
        ingest = AdapterIngest(services.catalog, services.store, services.session_factory)
        done = await run_in_threadpool(ingest.ingest, upload)
    finally:
        await run_in_threadpool(upload.cleanup)
    services.adapters.invalidate()
    return await run_in_threadpool(_detail, services, done.adapter.id)


@router.get("")
def list_adapters(
    _: AdminDep,
    services: ServicesDep,
    owner: str | None = None,
    base_model: str | None = None,
    include_deleted: bool = False,
) -> AdapterList:
    with services.session_factory() as session:
        rows = adapter_registry.list_adapters(
            session, owner=owner, base_model=base_model, include_deleted=include_deleted
        )
        return AdapterList(data=[adapter_out(live) for live in rows])


@router.get("/{adapter_id}")
def get_adapter(adapter_id: str, _: AdminDep, services: ServicesDep) -> AdapterOut:
    return _detail(services, adapter_id)


@router.patch("/{adapter_id}")
def patch_adapter(adapter_id: str, body: AdapterPatch, _: AdminDep, services: ServicesDep) -> AdapterOut:
    """Pinning keeps the newest version in a device slot on every replica of its engine (applied within
    seconds by each replica's registry watcher)."""
    with services.session_factory() as session, session.begin():
        adapter_registry.set_pinned(session, adapter_id=adapter_id, pinned=body.pinned)
    return _detail(services, adapter_id)


@router.delete("/{adapter_id}")
def delete_adapter(adapter_id: str, _: AdminDep, services: ServicesDep) -> AdapterOut:
    """Unservable at once (404 to tenants), slots and CPU copies freed on every replica; the registry rows
    stay so usage history keeps pointing at it. Requests already running finish."""
    with services.session_factory() as session, session.begin():
        adapter_registry.delete_adapter(session, adapter_id=adapter_id)
    services.adapters.invalidate()
    if services.store.versions(adapter_id):  # deleting twice is fine: the files went the first time
        services.store.delete(adapter_id)
    return _detail(services, adapter_id)


def _detail(services: Services, adapter_id: str) -> AdapterOut:
    with services.session_factory() as session:
        adapter = adapter_registry.get_adapter(session, adapter_id=adapter_id)
        versions = adapter_registry.list_versions(session, adapter_id=adapter_id)
        out = [
            AdapterVersionOut(
                version=v.version,
                rank=v.rank,
                target_modules=v.target_modules,
                sha256=v.sha256,
                size_bytes=v.size_bytes,
                created_at=v.created_at,
            )
            for v in versions
        ]
        return adapter_out(LiveAdapter(adapter, versions[-1]), versions=out)
