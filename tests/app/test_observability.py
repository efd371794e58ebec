"""Observability in process: /healthz and /readyz (ready, and 503 naming the failed check when the database
or the limiter is away, or hangs), the loraplex_* metrics of completed, rate-limited and failed requests
(recorded in memory here, where there is no Ray), engine gauges and counters, the metering backlog, and
log records that carry the request id, tenant, model and adapter."""

import asyncio
import logging
import time
import uuid
from pathlib import Path

import httpx
import pytest

from app.admin_listener import AdminListener
from app.limits import WindowState
from app.log_context import attach
from app.main import create_app
from app.metrics import MEMORY
from billing.db import make_engine, make_session_factory
from deployments.engine_metrics import EngineMetrics
from tests.app.bare_serving import bare_serving
from tests.app.conftest import MODEL, Served
from tests.app.helpers import wait_for
from tests.app.test_rate_limits import DownLimiter, complete, make_tier
from tests.engine.helpers import drain, queued_adapters
from tests.model_fixtures import TinySetup


def upload(served: Served, name: str, owner: str, source: Path) -> str:
    """An adapter for `owner`; returns its id."""
    files = {
        "adapter_config": ("c.json", (source / "adapter_config.json").read_bytes()),
        "adapter_model": ("m.safetensors", (source / "adapter_model.safetensors").read_bytes()),
    }
    with served.admin() as admin:
        made = admin.post("/admin/adapters", data={"name": name, "owner": owner}, files=files)
    assert made.status_code == 201, made.text
    return str(made.json()["id"])


def test_healthz(served: Served) -> None:
    response = httpx.get(f"{served.url}/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_readyz_when_everything_answers(served: Served) -> None:
    response = httpx.get(f"{served.url}/readyz", timeout=10)
    assert response.status_code == 200, response.text
    assert response.json() == {
        "status": "ready",
        "checks": {"database": "ok", "limiter": "ok", f"engine:{MODEL}": "ok"},
    }


def test_docs_are_public_by_default(served: Served) -> None:
    """The embedded defaults keep /docs on the one port, for someone trying the API locally."""
    assert httpx.get(f"{served.url}/docs").status_code == 200
    assert "/v1/chat/completions" in httpx.get(f"{served.url}/openapi.json").json()["paths"]


def test_the_tenant_port_can_keep_docs_and_check_names_to_the_admin_listener(
    llama: TinySetup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the cluster recipe runs it: nothing on the public port describes the API or names a model."""
    with bare_serving(llama, tmp_path, public_docs=False, public_readiness_checks=False) as bare:
        listener = AdminListener(create_app(bare.services, routes="admin"), "127.0.0.1:0").start()
        admin_url = f"http://127.0.0.1:{listener.port}"
        try:
            for path in ("/docs", "/redoc", "/openapi.json"):
                hidden = httpx.get(f"{bare.url}{path}")
                assert hidden.status_code == 404, path  # before: 200, and the schema lists /admin too
                assert set(hidden.json()["error"]) == {"message", "type", "param", "code"}
            assert httpx.get(f"{admin_url}/docs").status_code == 200
            assert "/admin/tenants" in httpx.get(f"{admin_url}/openapi.json").json()["paths"]
            ready = httpx.get(f"{bare.url}/readyz", timeout=10)
            assert ready.status_code == 200 and ready.json() == {"status": "ready"}  # before: every model
            checks = httpx.get(f"{admin_url}/readyz", timeout=10).json()["checks"]
            assert checks == {"database": "ok", "limiter": "ok", f"engine:{MODEL}": "ok"}

            nowhere = make_session_factory(make_engine("postgresql+psycopg://nobody@127.0.0.1:1/none"))
            monkeypatch.setattr(bare.services, "session_factory", nowhere)
            down = httpx.get(f"{bare.url}/readyz", timeout=10)
            assert down.status_code == 503 and down.headers["retry-after"] == "1"
            body = down.json()
            assert body["status"] == "not_ready" and body["error"]["code"] == "not_ready"
            assert "checks" not in body
            assert MODEL not in down.text and "database" not in down.text
            named = httpx.get(f"{admin_url}/readyz", timeout=10).json()
            assert named["checks"]["database"] == "failed" and "database" in named["error"]["message"]
        finally:
            listener.stop()


def test_readyz_names_a_broken_database(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    nowhere = make_session_factory(make_engine("postgresql+psycopg://nobody@127.0.0.1:1/none"))
    monkeypatch.setattr(served.services, "session_factory", nowhere)
    response = httpx.get(f"{served.url}/readyz", timeout=10)
    assert response.status_code == 503
    body = response.json()
    assert body["error"]["code"] == "not_ready" and body["error"]["type"] == "server_error"
    assert "database" in body["error"]["message"] and "limiter" not in body["error"]["message"]
    assert body["checks"]["database"] == "failed" and body["checks"]["limiter"] == "ok"
    assert "127.0.0.1" not in response.text and "Error" not in response.text  # details go to the log only
    assert response.headers["retry-after"] == "1"


def test_readyz_names_a_limiter_outage(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(served.services, "limiter", DownLimiter())
    response = httpx.get(f"{served.url}/readyz", timeout=10)
    assert response.status_code == 503
    body = response.json()
    assert "limiter" in body["error"]["message"] and body["checks"]["limiter"] == "failed"
    assert body["checks"]["database"] == "ok" and body["checks"][f"engine:{MODEL}"] == "ok"


class HungLimiter(DownLimiter):
    """A limiter whose connection hangs: every call waits forever."""

    async def peek(self, tenant: str) -> WindowState:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


def test_readyz_never_hangs(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(served.services, "limiter", HungLimiter())
    started = time.monotonic()
    response = httpx.get(f"{served.url}/readyz", timeout=30)
    assert time.monotonic() - started < 10
    assert response.status_code == 503 and "no answer within" in response.json()["checks"]["limiter"]


def test_a_completed_request_is_counted_with_its_tokens_and_timings(served: Served) -> None:
    tenant_id, key = served.new_tenant(f"obs-{uuid.uuid4().hex[:8]}")
    response = complete(served, key, max_tokens=5)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    tags = {"tenant": tenant_id, "model": MODEL, "base_model": MODEL}
    wait_for(lambda: MEMORY.value("loraplex_requests", **tags) == 1)
    assert MEMORY.value("loraplex_requests", **tags, status="completed") == 1
    assert MEMORY.value("loraplex_prompt_tokens", **tags) == usage["prompt_tokens"]
    assert MEMORY.value("loraplex_completion_tokens", **tags) == usage["completion_tokens"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert MEMORY.value("loraplex_cached_prompt_tokens", **tags) == cached
    for histogram in ("loraplex_ttft_ms", "loraplex_queue_ms", "loraplex_request_latency_ms"):
        [value] = MEMORY.observations(histogram, **tags)
        assert value >= 0
    if usage["completion_tokens"] > 1:
        assert len(MEMORY.observations("loraplex_time_per_output_token_ms", **tags)) == 1
    [series] = [s for s in MEMORY.series("loraplex_requests") if s["tenant"] == tenant_id]
    assert series["engine_replica"] == served.engine.replica_name


def test_a_rate_limited_request_is_counted_as_rejected(served: Served) -> None:
    tenant_id, key = served.new_tenant(f"obs-rl-{uuid.uuid4().hex[:8]}", tier=make_tier(served, rpm=1))
    assert complete(served, key).status_code == 200
    assert complete(served, key).status_code == 429
    tags = {"tenant": tenant_id, "model": MODEL, "base_model": MODEL}
    wait_for(lambda: MEMORY.value("loraplex_requests", **tags) == 2)
    assert MEMORY.value("loraplex_requests", **tags, status="rejected", engine_replica="") == 1
    assert MEMORY.value("loraplex_limiter_rejections", tenant=tenant_id, reason="requests") == 1
    assert MEMORY.value("loraplex_prompt_tokens", **tags, engine_replica="") == 0  # nothing processed


def test_a_failed_request_is_counted_under_its_adapter(served: Served) -> None:
    tenant_id, key = served.new_tenant(f"obs-f-{uuid.uuid4().hex[:8]}")
    adapter_id = upload(served, "obs-fragile", tenant_id, served.setup.adapter_dirs["demo-sql"])
    served.break_adapter(adapter_id)
    failed = complete(served, key, model="obs-fragile")  # its stored weights broke: the platform's fault
    assert failed.status_code == 503 and failed.json()["error"]["code"] == "model_unavailable"
    tags = {"tenant": tenant_id, "model": "obs-fragile", "base_model": MODEL}
    wait_for(lambda: MEMORY.value("loraplex_requests", **tags) == 1)
    assert MEMORY.value("loraplex_requests", **tags, status="failed") == 1
    assert MEMORY.value("loraplex_limiter_rejections", tenant=tenant_id) == 0
    # The engine counts the failed load under the version (exported under a tag of its own here: the
    # engine counters of MODEL belong to the test below).
    EngineMetrics(served.engine, base_model="obs-fragile-engine").export_once()
    ref = f"{adapter_id}@v1"
    failures = served.engine.stats().adapter_load_failures[ref]
    assert failures >= 1
    tags = {"base_model": "obs-fragile-engine", "adapter": ref}
    assert MEMORY.value("loraplex_engine_adapter_load_failures", **tags) == failures


def test_a_request_refused_as_invalid(served: Served) -> None:
    tenant_id, key = served.new_tenant(f"obs-i-{uuid.uuid4().hex[:8]}", tier=make_tier(served))
    too_long = complete(served, key, prompt="word " * 5000, max_tokens=10)
    assert too_long.status_code == 400
    tags = {"tenant": tenant_id, "model": MODEL, "base_model": MODEL}
    wait_for(lambda: MEMORY.value("loraplex_requests", **tags) == 1)
    assert MEMORY.value("loraplex_requests", **tags, status="invalid") == 1


def test_engine_gauges_and_counters_follow_the_engine_stats(served: Served) -> None:
    metrics = EngineMetrics(served.engine, base_model=MODEL)
    metrics.export_once()
    stats = served.engine.stats()
    tags = {"base_model": MODEL}
    assert MEMORY.value("loraplex_engine_running", **tags) == stats.running == 0
    assert MEMORY.value("loraplex_engine_kv_usage", **tags) == stats.kv_usage
    assert MEMORY.value("loraplex_engine_device_adapters", **tags) == len(stats.device_adapters)
    assert MEMORY.value("loraplex_engine_adapter_loads", **tags) == stats.adapter_loads
    assert MEMORY.value("loraplex_engine_adapter_requests", **tags) == stats.adapter_requests
    assert MEMORY.value("loraplex_engine_adapter_read_waits", **tags) == stats.adapter_read_waits
    # Counters move by increments: a second refresh with nothing new adds nothing.
    metrics.export_once()
    assert MEMORY.value("loraplex_engine_adapter_loads", **tags) == stats.adapter_loads
    assert MEMORY.value("loraplex_engine_busy_seconds", **tags) == pytest.approx(stats.busy_seconds)
    tenant_id, key = served.new_tenant(f"obs-e-{uuid.uuid4().hex[:8]}")
    assert complete(served, key, max_tokens=3).status_code == 200
    metrics.export_once()
    stats = served.engine.stats()
    assert MEMORY.value("loraplex_engine_busy_seconds", **tags) == pytest.approx(stats.busy_seconds)
    # The fair order's counters and preemptions by reason, per tenant and reason.
    service = MEMORY.value("loraplex_engine_tenant_service", **tags, tenant=tenant_id)
    assert service == stats.tenant_service[tenant_id] > 0
    for reason, count in stats.preemptions_by_reason.items():
        assert MEMORY.value("loraplex_engine_preemptions_by_reason", **tags, reason=reason) == count
    for ref, rank in stats.resident_ranks.items():
        assert MEMORY.value("loraplex_engine_resident_adapter_rank", **tags, adapter=ref) == rank


def test_adapter_queues_rotation_and_ranks_are_exported_with_a_bounded_adapter_label(
    llama: TinySetup,
) -> None:
    engine, (x, y, z, _) = queued_adapters(llama)  # x runs; y, z and w queue 3, 2 and 1
    tags = {"base_model": f"rotation-{uuid.uuid4().hex[:6]}"}
    metrics = EngineMetrics(engine, base_model=tags["base_model"])
    metrics.export_once()
    queue = {
        r["adapter"] for r in MEMORY.series("loraplex_engine_adapter_queue") if r.items() >= tags.items()
    }
    assert queue == {str(y), str(z)}  # the deepest two only
    assert MEMORY.value("loraplex_engine_adapter_queue", **tags, adapter=str(y)) == 3
    assert MEMORY.value("loraplex_engine_adapter_queue_other", **tags) == 1
    assert MEMORY.value("loraplex_engine_adapters_queued", **tags) == 3
    assert MEMORY.value("loraplex_engine_adapter_rotation_position", **tags, adapter=str(y)) == 1
    assert MEMORY.value("loraplex_engine_adapter_rotation_position", **tags, adapter=str(z)) == 2
    rank = engine.adapters.specs.cached(x).max_rank  # type: ignore[union-attr]
    assert MEMORY.value("loraplex_engine_resident_adapter_rank", **tags, adapter=str(x)) == rank
    assert MEMORY.value("loraplex_engine_resident_adapters_by_rank", **tags, rank=str(rank)) == 1
    assert MEMORY.value("loraplex_engine_adapter_pages", **tags, state="total") == 1  # one page of 16
    assert MEMORY.value("loraplex_engine_adapter_pages", **tags, state="in_use") == 1
    drain(engine)
    engine._queue_stats = None
    metrics.export_once()
    engine.close()
    for name in ("adapter_queue", "adapter_rotation_position"):
        assert MEMORY.value(f"loraplex_engine_{name}", **tags) == 0  # every adapter's series back to 0
    assert MEMORY.value("loraplex_engine_adapters_queued", **tags) == 0


def test_metering_backlog_is_published(served: Served) -> None:
    _, key = served.new_tenant(f"obs-m-{uuid.uuid4().hex[:8]}")
    assert complete(served, key).status_code == 200
    wait_for(lambda: MEMORY.series("loraplex_metering_backlog") == [{}])
    wait_for(lambda: MEMORY.value("loraplex_metering_backlog") == 0)  # delivered: the outbox is empty


def test_log_records_carry_the_request_id_tenant_and_adapter(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    tenant_id, key = served.new_tenant(f"obs-log-{uuid.uuid4().hex[:8]}")
    adapter_id = upload(served, "obs-sql", tenant_id, served.setup.adapter_dirs["demo-sql"])
    attach(caplog.handler)  # what route_to_serve does to Serve's handlers in a replica
    with caplog.at_level(logging.INFO, logger="app"):
        response = complete(served, key, model="obs-sql", max_tokens=3)
        assert response.status_code == 200, response.text
        wait_for(lambda: any(getattr(r, "tenant", None) == tenant_id for r in caplog.records))
    [record] = [r for r in caplog.records if getattr(r, "tenant", None) == tenant_id]
    assert record.name == "app.completions.lifecycle" and "completed" in record.getMessage()
    assert record.request_id == response.json()["id"]  # type: ignore[attr-defined]
    assert record.trace_id == response.headers["x-request-id"]  # type: ignore[attr-defined]
    assert record.model == "obs-sql"  # type: ignore[attr-defined]
    assert record.adapter == f"{adapter_id}@v1"  # type: ignore[attr-defined]
    # Outside a request nothing is stamped.
    logging.getLogger("app.test").warning("no request here")
    assert not hasattr(caplog.records[-1], "tenant")
