"""An adapter its engine cannot read, through the real Serve app: while another tenant's stream runs on the
same engine replica, a request for a registered adapter whose stored files are gone is a 503 with
retry-after, and one for an adapter deleted since is a 404, both in the OpenAI shape, naming no internal
id; the stream finishes, and the engine replica is the same one (it did not die and restart). Before, such
a request answered 500 quoting `adapter 'ad_...@v1' does not exist`, or ended the replica's engine loop."""

import json
import threading
import time
import uuid
from typing import Any

import httpx
import ray
from sqlalchemy import select

from billing import adapter_registry
from billing.models.usage import UsageEvent
from tests.app.test_adapters_api import assert_tenant_error, register_without_files
from tests.e2e.conftest import ServeApp

MODEL = "tiny-llama"
NEIGHBOUR_TOKENS = 960  # most of the tiny model's 1,024 positions: every failure below lands inside it


def engine_replica_actors() -> set[str]:
    actors = ray.util.list_named_actors(all_namespaces=True)
    return {a["name"] for a in actors if f"#engine-{MODEL}#" in a["name"]}


class Neighbour(threading.Thread):
    """Another tenant's long stream on the base model."""

    def __init__(self, app: ServeApp, key: str) -> None:
        super().__init__(daemon=True)
        self.app, self.key = app, key
        self.streaming = threading.Event()
        self.events: list[dict[str, Any]] = []
        self.failure: BaseException | None = None

    def run(self) -> None:
        config = json.loads((self.app.setups["llama"].model_dir / "generation_config.json").read_text())
        never_ends = {str(eos): -100 for eos in config["eos_token_id"]}  # it runs to max_tokens
        body = {
            "model": MODEL,
            "prompt": "go on",
            "max_tokens": NEIGHBOUR_TOKENS,
            "temperature": 0,
            "logit_bias": never_ends,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"authorization": f"Bearer {self.key}"}
        try:
            with httpx.stream("POST", f"{self.app.url}/v1/completions", json=body, headers=headers,
                              timeout=120) as response:  # fmt: skip
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        self.events.append(json.loads(line[6:]))
                        self.streaming.set()
        except BaseException as error:  # the test reads it below
            self.failure = error


def test_an_unreadable_adapter_fails_alone_and_the_replica_serves_on(serve_app: ServeApp) -> None:
    actors = engine_replica_actors()
    _, neighbour_key = serve_app.new_tenant(f"e2e-nb-{uuid.uuid4().hex[:8]}", tier="enterprise")
    tenant_id, key = serve_app.new_tenant(f"e2e-lost-{uuid.uuid4().hex[:8]}", tier="enterprise")
    register_without_files(serve_app.sessions(), "vanished", tenant_id, MODEL)
    adapter_id = register_without_files(serve_app.sessions(), "deleted", tenant_id, MODEL)

    neighbour = Neighbour(serve_app, neighbour_key)
    neighbour.start()
    assert neighbour.streaming.wait(60), neighbour.failure
    with httpx.Client(base_url=serve_app.url, headers={"authorization": f"Bearer {key}"}, timeout=60) as http:
        body = {"model": "vanished", "prompt": "hi", "max_tokens": 2}
        for stream in (False, True):
            assert_tenant_error(http.post("/v1/completions", json={**body, "stream": stream}), 503,
                                "model_unavailable")  # fmt: skip
        assert_tenant_error(http.post("/v1/completions", json={**body, "model": "deleted"}), 503,
                            "model_unavailable")  # fmt: skip
        with serve_app.sessions()() as session, session.begin():
            adapter_registry.delete_adapter(session, adapter_id=adapter_id)
        gone = http.post("/v1/completions", json={**body, "model": "deleted"})
        assert "deleted" in assert_tenant_error(gone, 404, "model_not_found")["message"]
        assert neighbour.is_alive(), "the neighbour's stream ended before the failures: nothing was tested"

    neighbour.join(120)
    assert not neighbour.is_alive() and neighbour.failure is None, neighbour.failure
    chunks = [e for e in neighbour.events if e["choices"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert neighbour.events[-1]["usage"]["completion_tokens"] == NEIGHBOUR_TOKENS
    assert engine_replica_actors() == actors, "an engine replica died and was replaced"
    with serve_app.sessions()() as session:  # billed by the replica that served it all along
        deadline = time.monotonic() + 30
        query = select(UsageEvent).where(UsageEvent.request_id == chunks[0]["id"])
        while not (rows := list(session.scalars(query))):
            assert time.monotonic() < deadline, "the neighbour's usage row never came"
            time.sleep(0.2)
            session.expire_all()
    [row] = rows
    assert row.status == "completed" and row.replica is not None
    assert any(row.replica.endswith(actor.rsplit("#", 1)[-1]) for actor in actors), (row.replica, actors)
