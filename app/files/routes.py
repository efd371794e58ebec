"""The Files API (issue 37): POST /v1/files (multipart: `file` and `purpose` batch), GET /v1/files,
GET /v1/files/{id}, GET /v1/files/{id}/content and DELETE /v1/files/{id}, each the calling tenant's own.

An upload streams to disk under its limits (app/upload.py) and is checked as it arrives, a JSONL line at a
time (app/files/jsonl.py), never held whole; once complete it is measured against the tenant's storage
quota and stored (app/files/store.py). `batch_output` files are the batch runner's, never uploaded.
"""

from datetime import timedelta
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from app.auth.authenticator import Principal
from app.cursor_page import list_page
from app.deps import ReaderDep, ServicesDep, TenantDep
from app.errors import FileQuotaExceeded, InvalidParameter, NotFound
from app.files.jsonl import JsonlCheck
from app.files.store import FileRecord, FileStore, QuotaExceeded
from app.responses.store import ResponseStore
from app.route_guards import TenantRoute
from app.services import Services
from app.storage import stored_bytes
from app.upload import UPLOADS_DIR, Upload, receive_upload
from billing.models import utcnow

router = APIRouter(prefix="/v1", tags=["files"], route_class=TenantRoute)

MULTIPART_ALLOWANCE = 64 * 1024  # an upload's body is its file plus this much multipart framing and fields
MIN_EXPIRY_S = 3600  # expires_after.seconds, as OpenAI: an hour at least
UPLOADED_PURPOSES = ("batch",)
EXPIRY_FIELDS = ("expires_after[anchor]", "expires_after[seconds]")


def missing(file_id: str, param: str | None = None) -> NotFound:
    """The same answer for an id that never existed, expired, was deleted or is another tenant's."""
    return NotFound(f"No such File object: {file_id[:64]}", param=param)


async def tenant_file(services: Services, principal: Principal, file_id: str) -> FileRecord:
    record = await run_in_threadpool(services.file_store().get, principal.tenant_id, file_id)
    if record is None:
        raise missing(file_id)
    return record


@router.post("/files")
async def upload_file(request: Request, principal: TenantDep, services: ServicesDep) -> JSONResponse:
    """multipart/form-data: `file` (JSONL, one request per line) and `purpose` ("batch"); optionally
    `expires_after[anchor]` ("created_at") and `expires_after[seconds]`."""
    settings = services.settings
    check = JsonlCheck(
        max_bytes=settings.files.max_bytes,
        max_lines=settings.files.max_lines,
        max_line_bytes=settings.max_body_kb * 1024,  # a line is a request body: no larger than one sent alone
    )
    upload = await receive_upload(
        request,
        tmp_root=settings.data_dir / UPLOADS_DIR,
        max_bytes=settings.files.max_bytes + MULTIPART_ALLOWANCE,
        allowed_file_fields={"file"},
        on_data=lambda _, data: check.feed(data),
        on_field=_early,  # a wrong purpose sent before the file is refused before the file is read
    )
    try:
        return JSONResponse((await _store(upload, check, principal, services)).to_api())
    finally:
        await run_in_threadpool(upload.cleanup)


async def _store(upload: Upload, check: JsonlCheck, principal: Principal, services: Services) -> FileRecord:
    purpose = _purpose(upload.fields)
    lifetime = _lifetime(upload.fields, services.settings.files.retention_days)
    unknown = sorted(set(upload.fields) - {"purpose", *EXPIRY_FIELDS})
    if unknown:
        raise InvalidParameter(
            f"Unknown field '{unknown[0][:64]}'.", param=unknown[0], code="unknown_parameter"
        )
    received = upload.files.get("file")
    if received is None:
        raise InvalidParameter("A `file` part is required.", param="file", code="missing_required_parameter")
    await run_in_threadpool(check.end)
    store = services.file_store()
    quota = principal.max_stored_response_bytes
    if quota is not None:
        responses = ResponseStore(services.session_factory, services.settings.responses)
        used = (await run_in_threadpool(stored_bytes, responses, store, principal.tenant_id)).total
        if used + received.size > quota:
            raise FileQuotaExceeded(used=used, needed=received.size, quota=quota, tier=principal.tier)
    try:
        return await run_in_threadpool(
            lambda: store.create(
                principal.tenant_id,
                purpose=purpose,
                filename=received.filename or "upload.jsonl",
                source=received.path,
                size=received.size,
                lines=check.lines,
                expires_at=utcnow() + lifetime,
                quota=quota,
            )
        )
    except QuotaExceeded as full:  # concurrent uploads passed the check above together
        tier = principal.tier
        raise FileQuotaExceeded(used=full.used, needed=full.needed, quota=full.quota, tier=tier) from None


def _early(name: str, value: str) -> None:
    if name == "purpose":
        _purpose({name: value})


def _purpose(fields: dict[str, str]) -> str:
    purpose = fields.get("purpose")
    if purpose is None:
        raise InvalidParameter(
            '`purpose` is required: "batch".', param="purpose", code="missing_required_parameter"
        )
    if purpose == "batch_output":
        message = (
            "Files of purpose batch_output are a batch's output and error files, written by the Batch "
            'API; upload batch input with purpose "batch".'
        )
        raise InvalidParameter(message, param="purpose", code="invalid_purpose")
    if purpose not in UPLOADED_PURPOSES:
        message = (
            f"Purpose '{purpose[:64]}' is not supported here; files are uploaded as batch input, "
            'purpose "batch".'
        )
        raise InvalidParameter(message, param="purpose", code="invalid_purpose")
    return purpose


def _lifetime(fields: dict[str, str], retention_days: float) -> timedelta:
    """How long the file lives: `expires_after` (anchored at its creation) or the configured retention."""
    retention = timedelta(days=retention_days)
    anchor, seconds = (fields.get(name) for name in EXPIRY_FIELDS)
    if anchor is None and seconds is None:
        return retention
    if anchor != "created_at":
        raise InvalidParameter('expires_after[anchor] must be "created_at".', param="expires_after.anchor")
    longest = int(retention.total_seconds())
    if seconds is None or not seconds.isdigit() or not MIN_EXPIRY_S <= int(seconds) <= longest:
        message = (
            f"expires_after[seconds] must be a whole number of seconds from {MIN_EXPIRY_S:,} to {longest:,}."
        )
        raise InvalidParameter(message, param="expires_after.seconds")
    return timedelta(seconds=int(seconds))


@router.get("/files")
async def list_files(
    principal: ReaderDep,
    services: ServicesDep,
    purpose: Annotated[str | None, Query(max_length=64)] = None,
    after: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
) -> JSONResponse:
    """The tenant's live files, newest first unless order is asc; `after` a file id (the SDK's cursor)."""
    store: FileStore = services.file_store()
    page, more = await run_in_threadpool(
        lambda: store.page(principal.tenant_id, purpose=purpose, after=after, limit=limit, order=order)
    )
    data = [record.to_api() for record in page]
    return JSONResponse(list_page(data, more))


@router.get("/files/{file_id}")
async def get_file(file_id: str, principal: ReaderDep, services: ServicesDep) -> JSONResponse:
    return JSONResponse((await tenant_file(services, principal, file_id)).to_api())


@router.get("/files/{file_id}/content")
async def file_content(file_id: str, principal: ReaderDep, services: ServicesDep) -> StreamingResponse:
    record = await tenant_file(services, principal, file_id)
    chunks = await run_in_threadpool(services.file_store().content, record)
    headers = {"content-length": str(record.bytes)}
    return StreamingResponse(chunks, media_type="application/octet-stream", headers=headers)


@router.delete("/files/{file_id}")
async def delete_file(file_id: str, principal: TenantDep, services: ServicesDep) -> JSONResponse:
    if not await run_in_threadpool(services.file_store().delete, principal.tenant_id, file_id):
        raise missing(file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})
