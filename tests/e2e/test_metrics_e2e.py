"""Observability on Ray Serve: after some requests, the node's Prometheus export (Ray's metrics agent, what
Prometheus scrapes) has the loraplex_* series with their tenant, model and Serve replica tags, from the
ingress and from the engine replicas; /readyz finds every engine loaded; and the ingress's log lines, written
through Serve's logger, carry our request id."""

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from billing.models import Tier
from tests.e2e.conftest import ServeApp

MODEL = "tiny-llama"


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def scrape(app: ServeApp) -> list[Sample]:
    text = httpx.get(app.metrics_url, timeout=30).text
    return [
        Sample(s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("ray_loraplex_")
    ]


def find(samples: list[Sample], name: str, **labels: str) -> list[Sample]:
    return [s for s in samples if s.name == name and labels.items() <= s.labels.items()]


def wait_for_samples(
    app: ServeApp, ready: Callable[[list[Sample]], bool], timeout: float = 120
) -> list[Sample]:
    """Workers export every few seconds; the agent serves what it last received."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(app)
        if ready(samples):
            return samples
        assert time.monotonic() < deadline, sorted({s.name for s in samples})
        time.sleep(1)


def limited_tenant(app: ServeApp, **limits: object) -> tuple[str, str]:
    tier = f"obs-{uuid.uuid4().hex[:8]}"
    sessions = app.sessions()  # the app's own database: PostgreSQL under CI
    with sessions() as session, session.begin():
        session.add(Tier(name=tier, description="e2e", **limits))
    return app.new_tenant(f"obs-{uuid.uuid4().hex[:8]}", tier=tier)


def complete(app: ServeApp, key: str, **body: object) -> httpx.Response:
    payload = {"model": MODEL, "prompt": "count to ten", "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(
        f"{app.url}/v1/completions", json=payload, headers={"authorization": f"Bearer {key}"}, timeout=120
    )


def test_metrics_are_exported_per_tenant_model_and_replica(serve_app: ServeApp) -> None:
    tenant_id, key = limited_tenant(serve_app, rpm=3)
    answers = [complete(serve_app, key), complete(serve_app, key, stream=True), complete(serve_app, key)]
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    assert complete(serve_app, key).status_code == 429

    def complete_picture(samples: list[Sample]) -> bool:
        # Every series the checks below read: Ray exports each on its own schedule, so one being there
        # says nothing about another.
        done = find(samples, "ray_loraplex_requests_total", tenant=tenant_id, status="completed")
        limited = find(samples, "ray_loraplex_limiter_rejections_total", tenant=tenant_id, reason="requests")
        return (
            sum(s.value for s in done) == 3
            and bool(find(samples, "ray_loraplex_requests_total", tenant=tenant_id, status="rejected"))
            and sum(s.value for s in limited) >= 1
            and sum(s.value for s in find(samples, "ray_loraplex_ttft_ms_count", tenant=tenant_id)) >= 3
            and bool(find(samples, "ray_loraplex_queue_ms_count", tenant=tenant_id))
            and bool(find(samples, "ray_loraplex_engine_kv_usage", base_model=MODEL))
            and bool(find(samples, "ray_loraplex_metering_backlog"))
        )

    samples = wait_for_samples(serve_app, complete_picture)
    for completed in find(samples, "ray_loraplex_requests_total", tenant=tenant_id, status="completed"):
        assert completed.labels["model"] == MODEL and completed.labels["base_model"] == MODEL
        assert completed.labels["deployment"] == "ingress" and completed.labels["replica"]  # Serve's tags
        assert completed.labels["engine_replica"].startswith(f"{MODEL}:")  # the engine replica that served
    rejected = find(samples, "ray_loraplex_limiter_rejections_total", tenant=tenant_id, reason="requests")
    assert sum(s.value for s in rejected) == 1
    prompt = find(samples, "ray_loraplex_prompt_tokens_total", tenant=tenant_id)
    generated = find(samples, "ray_loraplex_completion_tokens_total", tenant=tenant_id)
    assert sum(s.value for s in prompt) > 0 and sum(s.value for s in generated) > 0
    ttft = find(samples, "ray_loraplex_ttft_ms_count", tenant=tenant_id)
    assert sum(s.value for s in ttft) == 3
    assert find(samples, "ray_loraplex_time_per_output_token_ms_bucket", tenant=tenant_id, le="+Inf")
    assert find(samples, "ray_loraplex_queue_ms_count", tenant=tenant_id)

    # The engine replicas' own series (one per replica): tagged with their deployment and replica by Serve.
    for kv in find(samples, "ray_loraplex_engine_kv_usage", base_model=MODEL):
        assert kv.labels["deployment"] == f"engine-{MODEL}" and kv.labels["replica"]
        assert 0 <= kv.value <= 1
    assert find(samples, "ray_loraplex_engine_running", base_model=MODEL)
    assert find(samples, "ray_loraplex_engine_waiting", base_model=MODEL)
    assert find(samples, "ray_loraplex_engine_busy_seconds_total", base_model=MODEL)
    for backlog in find(samples, "ray_loraplex_metering_backlog"):
        assert backlog.labels["deployment"] == "ingress" and backlog.value >= 0


def test_readyz_and_healthz(serve_app: ServeApp) -> None:
    assert httpx.get(f"{serve_app.url}/healthz", timeout=30).json() == {"status": "ok"}
    response = httpx.get(f"{serve_app.url}/readyz", timeout=30)
    assert response.status_code == 200, response.text
    checks = response.json()["checks"]
    assert checks["database"] == checks["limiter"] == checks[f"engine:{MODEL}"] == "ok"
    assert all(result == "ok" for result in checks.values()), checks


def test_ingress_log_lines_carry_our_request_id(serve_app: ServeApp) -> None:
    from ray.serve._private.logging_utils import get_serve_logs_dir

    _, key = serve_app.new_tenant(f"obs-log-{uuid.uuid4().hex[:8]}")
    response = complete(serve_app, key)
    assert response.status_code == 200, response.text
    request_id = response.json()["id"]
    logs = Path(get_serve_logs_dir())
    deadline = time.monotonic() + 30
    while not any(
        request_id in line and "generation completed" in line
        for path in logs.glob("replica_*ingress*.log")
        for line in path.read_text(errors="replace").splitlines()
    ):
        assert time.monotonic() < deadline, f"no log line with {request_id} in {logs}"
        time.sleep(0.5)
