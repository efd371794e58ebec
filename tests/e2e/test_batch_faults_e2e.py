"""A batch through faults on Ray Serve (issue 37's fault test): mid-batch, the engine replica is killed,
then the ingress replica (whose runner holds lines under its lease), then the whole application is
deleted and deployed again. Every custom_id is answered exactly once in the output file, none lost to the
error file, and each line has exactly one usage row, for the run that answered it."""

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import ray
from openai import OpenAI
from ray import serve
from sqlalchemy import func, select

from app.batches.lines import line_request_id
from billing.models import BatchLine, UsageEvent
from tests.app.test_batch_runner import file_lines
from tests.app.test_files_api import jsonl
from tests.e2e.conftest import APP_NAME, ServeApp, engine_settings, wait_for
from tests.e2e.test_batches_e2e import line

LINES = 48
TOKENS = 48
# Short leases and waits, so a killed runner's lines come back within seconds; two lines in flight, so the
# batch lasts long enough for three faults. The retry waits (1, 2, 4, 8, 8, ... s over 8 attempts)
# outlast an engine replica's restart.
BATCHES = {"lease_s": 3.0, "poll_interval_s": 0.2, "retry_base_s": 1.0, "retry_max_s": 8.0,
           "max_in_flight_per_tenant": 2}  # fmt: skip


@pytest.fixture(scope="module")
def deployed(serve_app: ServeApp) -> Iterator[Callable[[], None]]:
    args = {
        "models": [{"name": "tiny-llama", "engine": engine_settings(serve_app.setups["llama"])}],
        "ingress_settings": {"batches": BATCHES},
    }

    def deploy() -> None:
        serve_app.deploy(args)

    deploy()
    yield deploy
    serve_app.deploy_default()


def _actors(part: str) -> list[dict[str, Any]]:
    return [a for a in ray.util.list_named_actors(all_namespaces=True) if part in a["name"]]


def _kill(part: str) -> int:
    """SIGKILL-like: every replica actor of the deployment (Serve starts new ones)."""
    victims = _actors(part)
    for actor in victims:
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=False)
    return len(victims)


def _done(app: ServeApp, batch_id: str) -> int:
    with app.sessions()() as s:
        query = select(func.count()).where(BatchLine.batch_id == batch_id, BatchLine.state == "done")
        return int(s.scalar(query) or 0)


def _retrieve(client: OpenAI, batch_id: str) -> Any:
    """The batch, through the API while the ingress may be restarting (connection refused, 503s)."""
    for _ in range(600):
        try:
            return client.batches.retrieve(batch_id)
        except Exception:  # the ingress is coming back: asked again
            time.sleep(0.5)
    raise AssertionError("the API did not come back")


@pytest.mark.slow
def test_a_batch_survives_a_killed_engine_a_killed_ingress_and_a_redeploy(
    serve_app: ServeApp, deployed: Callable[[], None]
) -> None:
    tenant_id, key = serve_app.new_tenant(f"faults-{uuid.uuid4().hex[:8]}", tier="enterprise")
    client = OpenAI(base_url=f"{serve_app.url}/v1", api_key=key, max_retries=0, timeout=60)
    body = {"model": "tiny-llama", "prompt": "count", "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    lines = [line(f"line-{i}", "/v1/completions", body) for i in range(LINES)]
    file = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    faults: list[tuple[str, int]] = []

    wait_for(lambda: _done(serve_app, batch.id) >= 2, "the first lines", 120)
    assert _kill("#engine-tiny-llama#") == 1  # lines running on it fail: retried after a wait
    faults.append(("engine", _done(serve_app, batch.id)))
    wait_for(lambda: _done(serve_app, batch.id) >= faults[-1][1] + 4, "lines after the engine came back", 180)
    assert _kill("#ingress#") >= 1  # its runner's lines stay running under its lease, which lapses
    faults.append(("ingress", _done(serve_app, batch.id)))
    back = "lines after the ingress came back"
    wait_for(lambda: _done(serve_app, batch.id) >= faults[-1][1] + 4, back, 180)
    serve.delete(APP_NAME)  # the whole platform: every runner, engine and the metering replica
    faults.append(("platform", _done(serve_app, batch.id)))
    deployed()
    assert faults[-1][1] < LINES, f"the batch ended before the last fault: {faults}"

    deadline = time.monotonic() + 300
    while (done := _retrieve(client, batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"batch still {done.status}: {done.request_counts} after {faults}"
        time.sleep(0.5)
    assert done.status == "completed", done
    output, errors = file_lines(client, done.output_file_id), file_lines(client, done.error_file_id)
    assert sorted(output) == sorted(f"line-{i}" for i in range(LINES)), (sorted(errors), faults)
    assert not errors, (errors, faults)
    assert done.request_counts is not None and done.request_counts.completed == LINES

    ids = [line_request_id(batch.id, f"line-{i}") for i in range(LINES)]
    deadline = time.monotonic() + 120
    while True:  # the metering replica was killed too: its backlog reaches the database once it is back
        with serve_app.sessions()() as s:
            rows = list(s.scalars(select(UsageEvent).where(UsageEvent.tenant_id == tenant_id)))
        if len(rows) >= LINES or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sorted(r.request_id for r in rows) == sorted(ids)  # each line once, and nothing else
    for row in rows:
        assert row.status == "completed" and row.completion_tokens == TOKENS and row.batch_id == batch.id
    with httpx.Client(base_url=serve_app.url, timeout=30) as http:  # the platform serves as before
        reply = http.post("/v1/completions", json={**body, "max_tokens": 2},
                          headers={"authorization": f"Bearer {key}"})  # fmt: skip
        assert reply.status_code == 200, reply.text
    print(f"faults (kind, lines done when it struck): {faults}")
