"""GET /admin/engines: tenant isolation inside each engine replica, as the replicas report it (service per
tenant with its name, who waits, preemptions by reason, adapter queues, resident ranks)."""

import time
import uuid
from typing import Any

import httpx
import pytest

from deployments.engine.llm_engine import QUEUE_STATS_S
from deployments.engine_reporter import EngineReporter
from tests.app.conftest import MODEL, Served
from tests.app.test_adapters_api import upload_files
from tests.engine.helpers import drain, queued_adapters
from tests.model_fixtures import TinySetup


def engines(served: Served, **params: Any) -> list[dict[str, Any]]:
    with served.admin() as admin:
        response = admin.get("/admin/engines", params={"model": MODEL, **params})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list"
    return list(body["data"])


def test_each_tenants_service_and_the_resident_ranks_reach_the_admin_view(served: Served) -> None:
    tenant_id, key = served.new_tenant(f"iso-{uuid.uuid4().hex[:6]}")
    name = f"iso-{uuid.uuid4().hex[:6]}"
    uploaded = upload_files(served, name, tenant_id, served.setup.adapter_dirs["demo-sql"])
    assert uploaded.status_code == 201, uploaded.text
    with served.admin() as http:
        answer = http.post(
            "/v1/completions",
            headers={"authorization": f"Bearer {key}"},
            json={"model": name, "prompt": "select", "max_tokens": 3},
        )
    assert answer.status_code == 200, answer.text
    replica = f"{MODEL}:iso"
    time.sleep(QUEUE_STATS_S)  # the queue figures may be this stale: the report must see the queue empty
    EngineReporter(
        served.engine, replica=replica, base_model=MODEL, session_factory=served.services.session_factory
    ).report_once()

    shown = next(r for r in engines(served) if r["replica"] == replica)
    stats = served.engine.stats()
    assert shown["object"] == "engine.replica" and shown["base_model"] == MODEL
    tenant = next(t for t in shown["tenants"] if t["tenant_id"] == tenant_id)
    assert tenant["tenant_name"] == served_name(served, tenant_id)
    assert tenant["service"] == pytest.approx(stats.tenant_service[tenant_id]) and tenant["service"] > 0
    assert (tenant["waiting"], tenant["oldest_wait_s"]) == (0, None)
    services = [t["service"] for t in shown["tenants"]]
    assert services == sorted(services, reverse=True)  # most served first
    assert set(shown["preemptions"]) == {"kv", "adapter_slot", "fair", "batch"}
    ref = f"{uploaded.json()['id']}@v1"
    ranks = served.engine.stats().resident_ranks
    assert ref in ranks and shown["resident_ranks"][ref] == ranks[ref]  # the adapter it just ran
    assert shown["resident_by_rank"] == {str(r): list(ranks.values()).count(r) for r in set(ranks.values())}
    assert (shown["adapter_queue_other"], shown["adapters_queued"], shown["adapter_rotation"]) == (0, 0, [])
    assert engines(served, model="no-such-model") == []


def test_the_view_shows_the_deepest_adapter_queues_and_the_slot_rotation(
    served: Served, llama: TinySetup
) -> None:
    engine, (x, y, z, _) = queued_adapters(llama)  # x runs; y, z and w queue 3, 2 and 1
    replica = f"{MODEL}:rotation-{uuid.uuid4().hex[:6]}"
    reporter = EngineReporter(
        engine, replica=replica, base_model=MODEL, session_factory=served.services.session_factory
    )
    reporter.report_once()
    rank = engine.adapters.specs.cached(x).max_rank  # type: ignore[union-attr]
    drain(engine)
    engine.close()

    shown = next(r for r in engines(served) if r["replica"] == replica)
    assert shown["adapter_queue"] == {str(y): 3, str(z): 2}
    assert (shown["adapter_queue_other"], shown["adapters_queued"]) == (1, 3)
    assert shown["adapter_rotation"] == [str(y), str(z)]
    assert shown["resident_ranks"] == {str(x): rank} and shown["resident_by_rank"] == {str(rank): 1}
    # One slot's memory (max_loras 1 of max_lora_rank 16) in one page of 16 (the CPU's default page rank).
    assert shown["adapter_pages"] == {"total": 1, "in_use": 1, "page_rank": 16}


def served_name(served: Served, tenant_id: str) -> str:
    with served.admin() as admin:
        return str(admin.get(f"/admin/tenants/{tenant_id}").json()["name"])


def test_the_view_is_the_admins(served: Served) -> None:
    _, key = served.new_tenant(f"iso-{uuid.uuid4().hex[:6]}")

    answer = httpx.get(f"{served.url}/admin/engines", headers={"authorization": f"Bearer {key}"})
    assert answer.status_code in (401, 403) and "error" in answer.json()
    with served.admin() as admin:
        bad = admin.get("/admin/engines", params={"within_s": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "within_s"
