"""The Files API (issue 37, item 1) through the official OpenAI SDK: upload (streamed, checked as it
arrives), list with cursor pagination, retrieve, content, delete; each tenant's own; limits per file and the
tenant's storage quota (shared with stored responses), each a 4xx naming it; expired files swept."""

import json
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from sqlalchemy import select, update

from app.settings import BatchesConfig, FilesConfig
from billing.models import StoredFile, utcnow
from tests.app.conftest import MODEL, Served, serving
from tests.app.helpers import wait_for
from tests.app.test_error_contract import assert_error
from tests.model_fixtures import TinySetup

MAX_LINES = 40
MAX_BYTES = 16_000


@pytest.fixture(scope="module")
def served(llama: TinySetup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Small limits, so each is reached with a few lines; sweeps often."""
    files = FilesConfig(max_lines=MAX_LINES, max_bytes=MAX_BYTES, sweep_interval_s=0.1)
    batches = BatchesConfig(
        max_active=2, run_lines=False
    )  # lines stay queued: tests/app/test_batch_runner.py runs them
    with serving(llama, tmp_path_factory.mktemp("files"), files=files, batches=batches) as app:
        yield app


def client_for(served: Served, tier: str = "free") -> tuple[str, OpenAI]:
    tenant_id, key = served.new_tenant(f"files-{uuid.uuid4().hex[:8]}", tier=tier)
    return tenant_id, OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0)


def line(custom_id: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body},
    }


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(item).encode() + b"\n" for item in lines)


def upload(client: OpenAI, content: bytes, name: str = "input.jsonl") -> Any:
    return client.files.create(file=(name, content), purpose="batch")


def raw(
    client: OpenAI, method: str, path: str, headers: dict[str, str] | None = None, **kwargs: Any
) -> httpx.Response:
    """A call the SDK would not make as is, with the client's key."""
    headers = {"authorization": f"Bearer {client.api_key}", **(headers or {})}
    url = f"{client.base_url}{path.lstrip('/')}"
    return httpx.request(method, url, headers=headers, timeout=30, **kwargs)


def blob_path(served: Served, tenant_id: str, file_id: str) -> Any:
    return served.setup.store_root / ".files" / tenant_id / f"{file_id}.jsonl"


def uploads_left(served: Served) -> list[Any]:
    return list((served.data_dir / "uploads").glob("*"))


def test_a_file_goes_up_reads_back_byte_for_byte_and_is_deleted(served: Served) -> None:
    tenant_id, client = client_for(served)
    content = jsonl([line(f"req-{i}") for i in range(3)]) + b"\n"  # a blank line is allowed
    created = upload(client, content)
    assert created.object == "file" and created.purpose == "batch" and created.status == "processed"
    assert created.bytes == len(content) and created.filename == "input.jsonl"
    assert created.id.startswith("file-")
    expires = created.expires_at
    assert expires is not None and abs(expires - created.created_at - 30 * 86400) <= 1
    assert client.files.retrieve(created.id) == created
    assert client.files.content(created.id).read() == content
    assert blob_path(served, tenant_id, created.id).read_bytes() == content  # beside the adapters
    assert [f.id for f in client.files.list()] == [created.id]
    deleted = client.files.delete(created.id)
    assert deleted.deleted is True and deleted.id == created.id
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(created.id)
    assert not blob_path(served, tenant_id, created.id).exists()
    assert list(client.files.list()) == []
    assert uploads_left(served) == []


def test_another_tenants_file_is_not_found_for_every_call(served: Served) -> None:
    _, owner = client_for(served)
    _, other = client_for(served)
    created = upload(owner, jsonl([line("a")]))
    for call in (other.files.retrieve, other.files.content, other.files.delete):
        with pytest.raises(openai.NotFoundError) as caught:
            call(created.id)
        assert caught.value.status_code == 404
    assert list(other.files.list()) == []
    assert owner.files.retrieve(created.id).id == created.id  # untouched by the other's delete


@pytest.mark.parametrize(
    ("purpose", "code"),
    [
        ("batch_output", "invalid_purpose"),
        ("fine-tune", "invalid_purpose"),
        (None, "missing_required_parameter"),
    ],
)
def test_only_batch_input_is_uploaded(served: Served, purpose: str | None, code: str) -> None:
    _, client = client_for(served)
    data = {} if purpose is None else {"purpose": purpose}
    r = raw(client, "POST", "/files", data=data, files={"file": ("in.jsonl", jsonl([line("a")]))})
    assert_error(r, 400, code=code, param="purpose")
    assert list(client.files.list()) == []


def test_a_wrong_purpose_sent_first_is_refused_before_the_file_is_read(served: Served) -> None:
    """The SDK sends `purpose` before `file`: a wrong one is refused as it ends, so a file that would break
    every limit is never read (the answer names the purpose, not the file)."""
    _, client = client_for(served)
    content = b"not json at all\n" * (MAX_BYTES // 8)
    r = raw(client, "POST", "/files", data={"purpose": "fine-tune"}, files={"file": ("in.jsonl", content)})
    assert_error(r, 400, code="invalid_purpose", param="purpose")


def test_each_limit_of_a_file_is_a_4xx_naming_it_and_stores_nothing(served: Served) -> None:
    _, client = client_for(served)
    cases: list[tuple[bytes, int, str, str]] = [
        (jsonl([line(f"r{i}") for i in range(MAX_LINES + 1)]), 400, "too_many_lines", f"{MAX_LINES:,} lines"),
        (
            jsonl([line("big", stop=["x" * 100]) for _ in range(MAX_BYTES // 200)]),
            413,
            "file_too_large",
            "bytes",
        ),
        (jsonl([line("a")]) + b"{not json\n", 400, "invalid_jsonl", "Line 2"),
        (jsonl([line("a")]) + b"[1, 2]\n", 400, "invalid_jsonl", "Line 2"),
        (b"\n\n", 400, "empty_file", "no lines"),
    ]
    for content, status, code, words in cases:
        r = raw(client, "POST", "/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", content)})
        error = assert_error(r, status, code=code)
        assert words in error["message"], error
    assert list(client.files.list()) == []
    assert uploads_left(served) == []


def test_a_declared_body_past_the_file_limit_is_refused_unread(served: Served) -> None:
    """Past the file limit and the multipart allowance, the declared length alone is refused (413), not
    the 2 MB body limit of other routes, nor anything the upload would hold."""
    _, client = client_for(served)
    headers = {"content-type": "multipart/form-data; boundary=x"}
    r = raw(client, "POST", "/files", headers=headers, content=b"-" * (MAX_BYTES + 128 * 1024))
    assert_error(r, 413)


def test_files_share_the_tiers_storage_quota_with_stored_responses(served: Served) -> None:
    tier = f"files-quota-{uuid.uuid4().hex[:8]}"
    with served.admin() as admin:
        created = admin.post("/admin/tiers", json={"name": tier, "max_stored_response_bytes": 2500})
        assert created.status_code == 201, created.text
    _, client = client_for(served, tier=tier)
    content = jsonl([line(f"r{i}") for i in range(12)])[:1500].rsplit(b"\n", 1)[0] + b"\n"
    first = upload(client, content)
    with pytest.raises(openai.PermissionDeniedError) as caught:
        upload(client, content)
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "storage_quota_exceeded" and error["param"] == "file"
    assert "max_stored_response_bytes" in error["message"]
    period = {"start": "2020-01-01T00:00:00Z", "end": "2020-02-01T00:00:00Z"}
    storage = raw(client, "GET", "/usage", params=period).json()["storage"]
    assert storage["file_bytes"] == len(content) and storage["max_stored_response_bytes"] == 2500
    # A stored response counts against the same quota: with the file's bytes in use, it does not fit.
    body = {"model": MODEL, "input": "x" * 1200, "max_output_tokens": 1}
    assert_error(raw(client, "POST", "/responses", json=body), 403, code="storage_quota_exceeded")
    client.files.delete(first.id)
    assert upload(client, content).bytes == len(content)


def test_files_list_by_cursor_newest_first_or_oldest_first(served: Served) -> None:
    _, client = client_for(served)
    ids = [upload(client, jsonl([line(str(i))]), name=f"f{i}.jsonl").id for i in range(5)]
    newest_first = list(client.files.list(limit=2))  # the SDK follows `after` through three pages
    assert [f.id for f in newest_first] == ids[::-1]
    page = client.files.list(limit=2, order="asc")
    assert [f.id for f in page.data] == ids[:2] and page.has_more
    assert [f.id for f in client.files.list(limit=10, order="asc", after=ids[1])] == ids[2:]
    assert list(client.files.list(purpose="batch_output")) == []
    assert len(list(client.files.list(purpose="batch"))) == 5


def test_a_file_expires_when_asked_and_the_sweep_removes_it_and_its_bytes(served: Served) -> None:
    tenant_id, client = client_for(served)
    soon = client.files.create(
        file=("in.jsonl", jsonl([line("a")])),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert soon.expires_at == soon.created_at + 3600
    kept = upload(client, jsonl([line("b")]))
    for seconds in ("60", str(365 * 86400), "soon"):
        form = {"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": seconds}
        r = raw(client, "POST", "/files", data=form, files={"file": ("in.jsonl", jsonl([line("c")]))})
        assert_error(r, 400, param="expires_after.seconds")
    with served.services.session_factory() as s, s.begin():
        s.execute(
            update(StoredFile)
            .where(StoredFile.id == soon.id)
            .values(expires_at=utcnow() - timedelta(seconds=1))
        )
    with pytest.raises(openai.NotFoundError):  # expired: missing at once
        client.files.retrieve(soon.id)

    def ids() -> set[str]:
        with served.services.session_factory() as s:
            return set(s.scalars(select(StoredFile.id).where(StoredFile.tenant_id == tenant_id)))

    # The sweep removes the bytes, then the row: both go, the kept file stays.
    wait_for(lambda: not blob_path(served, tenant_id, soon.id).exists() and ids() == {kept.id}, timeout=10)
    assert client.files.content(kept.id).read() == jsonl([line("b")])


def test_a_disabled_tenants_files_go_with_their_bytes(served: Served) -> None:
    tenant_id, client = client_for(served)
    created = upload(client, jsonl([line("a")]))
    with served.admin() as admin:
        assert admin.delete(f"/admin/tenants/{tenant_id}").status_code == 200

    def rows() -> list[str]:
        with served.services.session_factory() as s:
            return list(s.scalars(select(StoredFile.id).where(StoredFile.tenant_id == tenant_id)))

    # The sweep removes the bytes, then the row: wait for both (a run here saw the row between the two).
    deadline = time.monotonic() + 10
    while (blob_path(served, tenant_id, created.id).exists() or rows()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not blob_path(served, tenant_id, created.id).exists()
    assert rows() == []
