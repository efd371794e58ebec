"""GET /admin/routing and `loraplex routing show`: the engine's routing counters, reported to the database
and aggregated (hit rate, loads, duplicate loads across replicas)."""

import json
import uuid
from collections.abc import Callable
from typing import Any

from typer.testing import Result

from billing.models import EngineReport
from deployments.engine_reporter import EngineReporter
from tests.app.conftest import MODEL, Served
from tests.app.helpers import wait_for
from tests.app.test_adapters_api import upload_files


def routing(served: Served) -> dict[str, Any]:
    """The routing report of MODEL (JSON, as the API returns it)."""
    with served.admin() as admin:
        response = admin.get("/admin/routing", params={"model": MODEL})
    assert response.status_code == 200, response.text
    data: list[dict[str, Any]] = response.json()["data"]
    return data[0] if data else {}


def test_the_engines_counters_reach_the_routing_report(served: Served, cli: Callable[..., Result]) -> None:
    tenant_id, key = served.new_tenant(f"routing-{uuid.uuid4().hex[:6]}")
    name = f"route-{uuid.uuid4().hex[:6]}"
    uploaded = upload_files(served, name, tenant_id, served.setup.adapter_dirs["demo-sql"])
    assert uploaded.status_code == 201, uploaded.text
    ref = f"{uploaded.json()['id']}@v1"
    wait_for(lambda: ref in served.engine.stats().cpu_adapters)  # the upload's prefetch, by the watcher
    reporter = EngineReporter(
        served.engine,
        replica=f"{MODEL}:here",
        base_model=MODEL,
        session_factory=served.services.session_factory,
    )
    reporter.report_once()
    before = next(r for r in routing(served)["replicas"] if r["replica"] == f"{MODEL}:here")

    with served.admin() as http:  # tenants' requests go through the same app
        for _ in range(3):
            answer = http.post(
                "/v1/completions",
                headers={"authorization": f"Bearer {key}"},
                json={"model": name, "prompt": "select", "max_tokens": 2},
            )
            assert answer.status_code == 200, answer.text
    reporter.report_once()
    after = next(r for r in routing(served)["replicas"] if r["replica"] == f"{MODEL}:here")

    assert after["adapter_requests"] - before["adapter_requests"] == 3
    # The upload prefetched the adapter into the CPU tier, so every request found it here: 3 hits, 1 load.
    assert after["adapter_hits"] - before["adapter_hits"] == 3
    assert after["adapter_loads"][ref] == 1

    shown = cli("--json", "routing", "show", "--model", MODEL)
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["data"][0]["base_model"] == MODEL
    human = cli("routing", "show")
    assert human.exit_code == 0, human.output
    assert f"{MODEL}: hit rate" in human.stdout and f"{MODEL}:here" in human.stdout


def test_duplicate_loads_count_versions_loaded_on_more_than_one_replica(served: Served) -> None:
    with served.services.session_factory() as session, session.begin():
        for replica, loads in (
            ("a", {"x@v1": 1, "y@v1": 2}),
            ("b", {"x@v1": 1}),
            ("c", {"x@v1": 1, "z@v1": 0}),
        ):
            session.add(
                EngineReport(
                    replica=f"dup-model:{replica}",
                    base_model="dup-model",
                    busy_ms=0.0,
                    wall_ms=0.0,
                    steps=0,
                    adapter_requests=10,
                    adapter_hits=9,
                    adapter_loads=loads,
                )
            )
    with served.admin() as admin:
        report = admin.get("/admin/routing", params={"model": "dup-model"}).json()["data"][0]
        assert admin.get("/admin/routing", params={"within_s": 0}).json()["error"]["param"] == "within_s"
    # x@v1 on three replicas: 2 duplicates; y@v1 read twice on one replica (evicted between): no duplicate.
    assert (report["duplicate_loads"], report["loads"], report["adapter_requests"]) == (2, 5, 30)
    assert report["hit_rate"] == 0.9
