"""The Batch API on Ray Serve, through the OpenAI SDK unchanged: a JSONL file uploaded, a chat batch (the
base model and the tenant's adapter) and a completions batch run by the ingress replicas' runners on
PostgreSQL, each custom_id once in the output or error file (a line's own 400 in the error file), one usage
row per line carrying its batch id."""

import time
import uuid
from typing import Any

import pytest
from openai import OpenAI
from sqlalchemy import select

from billing.models import UsageEvent
from tests.app.test_batch_runner import file_lines
from tests.app.test_files_api import jsonl
from tests.e2e.conftest import ServeApp
from tests.e2e.test_adapters_e2e import upload

FINAL = ("completed", "failed", "expired", "cancelled")


def line(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def run(client: OpenAI, lines: list[dict[str, Any]], endpoint: Any, timeout: float = 300) -> Any:
    file = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint=endpoint, completion_window="24h")
    deadline = time.monotonic() + timeout
    while batch.status not in FINAL:
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    return batch


@pytest.mark.slow
def test_chat_and_completions_batches_run_through_serve(serve_app: ServeApp) -> None:
    tenant_id, key = serve_app.new_tenant(f"batch-{uuid.uuid4().hex[:8]}", tier="enterprise")
    name = f"batcher-{uuid.uuid4().hex[:6]}"
    source = serve_app.setups["llama"].adapter_dirs["demo-sql"]
    made = upload(serve_app, name, tenant_id, source, "tiny-llama")
    assert made.status_code == 201, made.text
    client = OpenAI(base_url=f"{serve_app.url}/v1", api_key=key, max_retries=0, timeout=60)

    messages = [{"role": "user", "content": "count to three"}]
    chat = [
        *(line(f"base-{i}", "/v1/chat/completions", {"model": "tiny-llama", "messages": messages,
                                                      "max_tokens": 4, "temperature": 0}) for i in range(3)),
        *(line(f"adapter-{i}", "/v1/chat/completions", {"model": name, "messages": messages, "max_tokens": 4,
                                                         "temperature": 0}) for i in range(3)),
        line("too-long", "/v1/chat/completions", {"model": "tiny-llama", "messages": messages,
                                                  "max_tokens": 1_000_000}),
    ]  # fmt: skip
    batch = run(client, chat, "/v1/chat/completions")
    assert batch.status == "completed", batch
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (7, 6, 1)
    output, errors = file_lines(client, batch.output_file_id), file_lines(client, batch.error_file_id)
    assert set(output) == {f"{kind}-{i}" for kind in ("base", "adapter") for i in range(3)}
    assert set(errors) == {"too-long"}
    assert errors["too-long"]["response"]["status_code"] == 400
    assert "error" in errors["too-long"]["response"]["body"]
    for row in output.values():
        body = row["response"]["body"]
        assert row["response"]["status_code"] == 200 and body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] >= 1
    greedy = {output[f"base-{i}"]["response"]["body"]["choices"][0]["message"]["content"] for i in range(3)}
    assert len(greedy) == 1  # the same request at temperature 0, whichever replica and step ran it

    prompt = {"model": name, "prompt": "select", "max_tokens": 3}
    completions = [line(f"c-{i}", "/v1/completions", prompt) for i in range(4)]
    second = run(client, completions, "/v1/completions")
    assert second.status == "completed" and second.request_counts.completed == 4, second
    assert set(file_lines(client, second.output_file_id)) == {f"c-{i}" for i in range(4)}

    # Metered once per line that ran, each row marked with its batch (the 400 ran no tokens: no row).
    ids = {batch.id: 6, second.id: 4}
    deadline = time.monotonic() + 60
    while True:
        with serve_app.sessions()() as session:
            rows = list(session.scalars(select(UsageEvent).where(UsageEvent.tenant_id == tenant_id)))
        metered = {b: sum(1 for r in rows if r.batch_id == b) for b in ids}
        if metered == ids or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert metered == ids, metered
    assert len({r.request_id for r in rows}) == len(rows) == sum(ids.values())
