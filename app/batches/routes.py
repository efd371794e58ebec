"""The Batch API (issue 37, item 2): POST /v1/batches, GET /v1/batches/{id}, GET /v1/batches (newest first,
by cursor) and POST /v1/batches/{id}/cancel, each the calling tenant's own.

Creating a batch validates its whole input file before any line can run (app/batches/validation.py), inside
the request: the batch comes back `in_progress` with its lines queued for the runner, or `failed` with
line-numbered errors. Running the lines is the runner's (not here).
"""

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from app.batches.objects import BatchCreate
from app.batches.store import BatchStore, NewBatch
from app.batches.validation import Scan, model_errors, scan
from app.cursor_page import list_page
from app.deps import ReaderDep, ServicesDep, TenantDep
from app.errors import BatchLimitExceeded, InvalidParameter, NotFound
from app.files.routes import missing as missing_file
from app.files.store import FileRecord, FileStore
from app.route_guards import TenantRoute

router = APIRouter(prefix="/v1", tags=["batches"], route_class=TenantRoute)


def _missing(batch_id: str) -> NotFound:
    return NotFound(f"No such Batch object: {batch_id[:64]}")


@router.post("/batches")
async def create_batch(
    body: BatchCreate, principal: TenantDep, services: ServicesDep, request: Request
) -> JSONResponse:
    config = services.settings.batches
    files = services.file_store()
    record = await run_in_threadpool(files.get, principal.tenant_id, body.input_file_id)
    if record is None:
        raise missing_file(body.input_file_id, "input_file_id")
    if record.purpose != "batch":
        message = f"File {record.id} has purpose {record.purpose}; a batch reads a file of purpose batch."
        raise InvalidParameter(message, param="input_file_id", code="invalid_file")
    batches = BatchStore(services.session_factory)
    if await run_in_threadpool(batches.active, principal.tenant_id) >= config.max_active:
        raise BatchLimitExceeded(config.max_active)
    found = await run_in_threadpool(_scan, files, record, body.endpoint, config.max_errors, config.max_models)
    await model_errors(found, principal, services, config.max_errors)
    new = NewBatch(
        tenant_id=principal.tenant_id,
        key_id=principal.key_id,
        endpoint=body.endpoint,
        input_file_id=record.id,
        completion_window=body.completion_window,
        metadata=body.metadata,
    )
    if found.errors:
        return JSONResponse(await run_in_threadpool(batches.create_failed, new, found.errors))
    created = await run_in_threadpool(_create, batches, files, record, new, found.lines)
    runner = getattr(request.app.state, "batch_runner", None)
    if runner is not None:
        runner.wake()  # this replica starts its lines now; the others find them at their next poll
    return JSONResponse(created)


def _scan(files: FileStore, record: FileRecord, endpoint: str, max_errors: int, max_models: int) -> Scan:
    with files.blobs.open(record.blob) as handle:
        return scan(handle, endpoint, max_errors=max_errors, max_models=max_models)


def _create(
    batches: BatchStore, files: FileStore, record: FileRecord, new: NewBatch, total: int
) -> dict[str, Any]:
    with files.blobs.open(record.blob) as handle:
        return batches.create_running(new, handle, total)


@router.get("/batches")
async def list_batches(
    principal: ReaderDep,
    services: ServicesDep,
    after: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> JSONResponse:
    store = BatchStore(services.session_factory)
    page, more = await run_in_threadpool(lambda: store.page(principal.tenant_id, after=after, limit=limit))
    return JSONResponse(list_page(page, more))


@router.get("/batches/{batch_id}")
async def get_batch(batch_id: str, principal: ReaderDep, services: ServicesDep) -> JSONResponse:
    found = await run_in_threadpool(BatchStore(services.session_factory).get, principal.tenant_id, batch_id)
    if found is None:
        raise _missing(batch_id)
    return JSONResponse(found)


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, principal: TenantDep, services: ServicesDep) -> JSONResponse:
    found = await run_in_threadpool(
        BatchStore(services.session_factory).cancel, principal.tenant_id, batch_id
    )
    if found is None:
        raise _missing(batch_id)
    return JSONResponse(found)
