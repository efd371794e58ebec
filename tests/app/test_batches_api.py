"""The Batch API's batches (issue 37, item 2) through the official OpenAI SDK: a file validated whole before
any line runs (a failed batch lists its bad lines by number), lines stored for the runner, retrieve, list by
cursor, cancel before anything ran, the per-tenant limit, and another tenant's ids answered 404."""

from datetime import timedelta
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI
from sqlalchemy import select, update

from app.batches.lines import line_request_id
from billing.models import BatchLine, utcnow
from tests.app.conftest import MODEL, Served
from tests.app.test_adapters_api import upload_files
from tests.app.test_error_contract import assert_error
from tests.app.test_files_api import client_for, jsonl, line, raw, served, upload

__all__ = ["served"]  # the module's server (small limits; two unfinished batches per tenant)

ADAPTER = "batch-sql"


def lines_of(served: Served, batch_id: str) -> list[BatchLine]:
    with served.services.session_factory() as s:
        return list(
            s.scalars(select(BatchLine).where(BatchLine.batch_id == batch_id).order_by(BatchLine.line))
        )


def create(client: OpenAI, file_id: str, endpoint: Any = "/v1/chat/completions", **kwargs: Any) -> Any:
    return client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h", **kwargs)


def own_adapter(served: Served, tenant_id: str) -> None:
    response = upload_files(served, ADAPTER, tenant_id, served.setup.adapter_dirs["demo-sql"])
    assert response.status_code == 201, response.text


ENDPOINT_LINES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "Once upon", "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
}


def request_line(endpoint: str, custom_id: str, model: str = MODEL, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": endpoint,
        "body": {"model": model, **ENDPOINT_LINES[endpoint], **body},
    }


@pytest.mark.parametrize("endpoint", list(ENDPOINT_LINES))
def test_a_valid_file_makes_a_batch_in_progress_with_its_lines_queued(served: Served, endpoint: str) -> None:
    tenant_id, client = client_for(served)
    own_adapter(served, tenant_id)
    requests = [
        request_line(endpoint, "first"),
        request_line(endpoint, "second", model=ADAPTER),  # the tenant's own adapter
        request_line(endpoint, "third", temperature=0),
    ]
    file = upload(client, jsonl(requests[:2]) + b"\n" + jsonl(requests[2:]))  # line 3 is blank
    batch = create(client, file.id, endpoint, metadata={"job": "eval"})
    assert batch.status == "in_progress" and batch.endpoint == endpoint and batch.input_file_id == file.id
    assert batch.request_counts is not None and batch.request_counts.total == 3
    assert batch.request_counts.completed == batch.request_counts.failed == 0
    assert batch.metadata == {"job": "eval"} and batch.errors is None and batch.id.startswith("batch_")
    assert batch.expires_at == batch.created_at + 24 * 3600 and batch.in_progress_at is not None
    assert client.batches.retrieve(batch.id) == batch
    stored = lines_of(served, batch.id)
    assert [(row.line, row.custom_id, row.model, row.state) for row in stored] == [
        (1, "first", MODEL, "queued"),
        (2, "second", ADAPTER, "queued"),
        (4, "third", MODEL, "queued"),
    ]
    assert [row.body for row in stored] == [r["body"] for r in requests]
    assert [row.request_id for row in stored] == [line_request_id(batch.id, r["custom_id"]) for r in requests]
    assert len({row.request_id for row in stored}) == 3 and all(row.lease_owner is None for row in stored)


def test_a_file_with_bad_lines_fails_with_every_bad_line_numbered(served: Served) -> None:
    _, client = client_for(served)
    other_id, _ = client_for(served)
    own_adapter(served, other_id)  # another tenant's adapter: not this tenant's to use
    url = "/v1/chat/completions"
    bad: list[tuple[dict[str, Any], str, str | None]] = [
        (request_line(url, "a"), "duplicate_custom_id", "custom_id"),
        (request_line("/v1/completions", "b"), "mismatched_url", "url"),
        ({**request_line(url, "c"), "method": "GET"}, "invalid_method", "method"),
        ({**request_line(url, "d"), "body": {"model": MODEL}}, "invalid_body", "body.messages"),
        (request_line(url, "e", stream=True), "stream_not_supported", "body.stream"),
        (request_line(url, "f", model="no-such-model"), "model_not_found", "body.model"),
        ({**request_line(url, "g"), "custom_id": 7}, "invalid_custom_id", "custom_id"),
        (request_line(url, "h", model=ADAPTER), "model_not_found", "body.model"),
        (request_line(url, "i", temperature=5), "invalid_body", "body.temperature"),
    ]
    file = upload(client, jsonl([request_line(url, "a"), *(entry for entry, _, _ in bad)]))
    batch = create(client, file.id)
    assert batch.status == "failed" and batch.failed_at is not None and batch.in_progress_at is None
    assert batch.errors is not None and batch.errors.object == "list"
    got = [(e.line, e.code, e.param) for e in batch.errors.data or []]
    assert got == [(number, code, param) for number, (_, code, param) in enumerate(bad, start=2)]
    assert all(e.message for e in batch.errors.data or [])
    assert lines_of(served, batch.id) == []  # nothing of it can run


def test_responses_lines_may_neither_be_stored_nor_continue_one(served: Served) -> None:
    _, client = client_for(served)
    url = "/v1/responses"
    lines = [
        request_line(url, "kept", store=False),
        request_line(url, "stored", store=True),
        request_line(url, "chained", previous_response_id="resp_abc"),
    ]
    batch = create(client, upload(client, jsonl(lines)).id, url)
    assert batch.status == "failed" and batch.errors is not None
    got = [(e.line, e.code, e.param) for e in batch.errors.data or []]
    assert got == [
        (2, "store_not_supported", "body.store"),
        (3, "previous_response_not_supported", "body.previous_response_id"),
    ]


def test_another_tenants_file_and_batches_are_not_found(served: Served) -> None:
    _, owner = client_for(served)
    _, other = client_for(served)
    file = upload(owner, jsonl([line("a")]))
    with pytest.raises(openai.NotFoundError) as caught:
        create(other, file.id)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "input_file_id"
    batch = create(owner, file.id)
    for call in (other.batches.retrieve, other.batches.cancel):
        with pytest.raises(openai.NotFoundError):
            call(batch.id)
    assert list(other.batches.list()) == []
    assert owner.batches.retrieve(batch.id).status == "in_progress"  # untouched by the other's cancel


def test_the_request_itself_is_checked(served: Served) -> None:
    tenant_id, client = client_for(served)
    file = upload(client, jsonl([line("a")]))
    good = {"input_file_id": file.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    changes: list[tuple[dict[str, Any], str]] = [
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"completion_window": "48h"}, "completion_window"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"output_expires_after": {"anchor": "created_at", "seconds": 3600}}, "output_expires_after"),
    ]
    for change, param in changes:
        assert_error(raw(client, "POST", "/batches", json={**good, **change}), 400, param=param)
    output = served.services.file_store().create(
        tenant_id,
        purpose="batch_output",
        filename="out.jsonl",
        source=_written(served, jsonl([{"id": "x"}])),
        size=len(jsonl([{"id": "x"}])),
        lines=1,
        expires_at=utcnow() + timedelta(days=1),
    )
    r = raw(client, "POST", "/batches", json={**good, "input_file_id": output.id})
    assert_error(r, 400, code="invalid_file", param="input_file_id")
    assert list(client.batches.list()) == []


def _written(served: Served, content: bytes) -> Path:
    path = served.data_dir / "output.jsonl"
    path.write_bytes(content)
    return path


def test_cancel_ends_a_batch_nothing_of_which_ran_and_leaves_a_started_one_to_the_runner(
    served: Served,
) -> None:
    _, client = client_for(served)
    file = upload(client, jsonl([line("a"), line("b")]))
    waiting = create(client, file.id)
    cancelled = client.batches.cancel(waiting.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    assert cancelled.cancelling_at is not None and lines_of(served, waiting.id) == []  # never run or billed
    assert client.batches.cancel(waiting.id) == cancelled  # twice: the same
    started = create(client, file.id)
    with served.services.session_factory() as s, s.begin():
        s.execute(
            update(BatchLine)
            .where(BatchLine.batch_id == started.id, BatchLine.line == 1)
            .values(state="running", lease_owner="runner-1")
        )
    cancelling = client.batches.cancel(started.id)
    assert cancelling.status == "cancelling" and cancelling.cancelled_at is None
    # The running line is the runner's to end; the queued one is dropped at once (never run nor billed).
    assert [(row.line, row.state) for row in lines_of(served, started.id)] == [(1, "running")]
    failed = create(client, upload(client, jsonl([line("a", model="nope")])).id)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(failed.id)


def test_a_tenant_has_at_most_its_limit_of_unfinished_batches(served: Served) -> None:
    _, client = client_for(served)
    file = upload(client, jsonl([line("a")]))
    assert create(client, upload(client, jsonl([line("a", model="nope")])).id).status == "failed"
    first, _ = create(client, file.id), create(client, file.id)  # the failed one does not count
    body = {"input_file_id": file.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    r = raw(client, "POST", "/batches", json=body)
    assert_error(r, 429, code="batch_limit_exceeded")
    client.batches.cancel(first.id)
    assert create(client, file.id).status == "in_progress"


def test_batches_list_newest_first_by_cursor(served: Served) -> None:
    _, client = client_for(served)
    bad = upload(client, jsonl([line("a", model="nope")]))
    ids = [create(client, bad.id, metadata={"n": str(i)}).id for i in range(5)]  # failed: no limit
    assert [b.id for b in client.batches.list(limit=2)] == ids[::-1]  # three pages
    page = client.batches.list(limit=3)
    assert [b.id for b in page.data] == ids[:1:-1] and page.has_more
    assert [b.id for b in client.batches.list(after=ids[2])] == ids[1::-1]
    assert list(client.batches.list(after="batch_gone")) == []
