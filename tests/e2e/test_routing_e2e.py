"""Adapter-aware routing on a real Serve app with 3 engine replicas: bursts over 24 adapters load each
adapter on exactly one replica with a hit rate of at least 95% after warm-up, and a replica killed
mid-burst costs no lost or double-billed request. Serve's default router on the same workload (it loads
adapters on several replicas) is bench/routing.py's peer, not repeated here."""

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import ray
from sqlalchemy import select

from bench.routing_counters import RoutingDelta, routing_delta
from billing.models import UsageEvent
from tests.e2e.conftest import ServeApp, engine_settings
from tests.e2e.test_adapters_e2e import upload
from tests.e2e.test_metering_e2e import sessions

ADAPTERS = 24
REPLICAS = 3


def deploy(app: ServeApp, router: str) -> None:
    """3 fresh replicas (a config change restarts them), reporting their counters every 0.5 s. The spill
    threshold is high so that only routing, not load, decides where adapters go in this test."""
    engine = engine_settings(app.setups["llama"], max_cpu_loras=ADAPTERS, max_loras=4)
    app.deploy({"models": [{
        "name": "tiny-llama", "engine": engine, "num_replicas": REPLICAS, "router": router,
        "spill_factor": 4.0, "report_interval_s": 0.5,
    }]})  # fmt: skip
    wait_for_replicas(app, REPLICAS)


def wait_for_replicas(app: ServeApp, n: int, timeout: float = 60) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    fresh: list[dict[str, Any]]
    while len(fresh := routing(app, within_s=1.5)["replicas"]) != n:
        assert time.monotonic() < deadline, fresh
        time.sleep(0.25)
    return fresh


def routing(app: ServeApp, within_s: float | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {"model": "tiny-llama"}
    if within_s is not None:
        params["within_s"] = within_s
    with app.admin() as admin:
        data: list[dict[str, Any]] = admin.get("/admin/routing", params=params).json()["data"]
    return data[0] if data else {"replicas": []}


def snapshot(app: ServeApp) -> dict[str, dict[str, Any]]:
    time.sleep(1.5)  # three report intervals: every replica's counters are in
    return {r["replica"]: r for r in routing(app, within_s=1.5)["replicas"]}


async def burst(app: ServeApp, key: str, names: list[str], per_adapter: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(
        base_url=app.url, timeout=120, headers={"authorization": f"Bearer {key}"}
    ) as c:
        body = {"prompt": "select name from", "max_tokens": 3}
        calls = [
            c.post("/v1/completions", json={**body, "model": n}) for n in names for _ in range(per_adapter)
        ]
        return await asyncio.gather(*calls)


def workload(app: ServeApp, key: str, names: list[str]) -> dict[str, RoutingDelta]:
    """A warm-up burst (two concurrent first requests per adapter), then three bursts."""
    start = snapshot(app)
    answers = asyncio.run(burst(app, key, names, per_adapter=2))
    warm = snapshot(app)
    for _ in range(3):
        answers += asyncio.run(burst(app, key, names, per_adapter=1))
    end = snapshot(app)
    assert [a.status_code for a in answers] == [200] * len(answers), [a.text for a in answers if a.is_error]
    return {
        "warm_up": routing_delta(start, warm),
        "after": routing_delta(warm, end),
        "all": routing_delta(start, end),
    }


@pytest.fixture(scope="module")
def adapters(serve_app: ServeApp) -> Iterator[tuple[str, list[str]]]:
    """24 public adapters (one tenant uses them all), uploaded before the routing deployments start, so
    nothing is prefetched: every load is the router's doing. The usual app is restored afterwards."""
    _, key = serve_app.new_tenant(f"route-{uuid.uuid4().hex[:8]}", tier="enterprise")
    tag = uuid.uuid4().hex[:6]
    names = []
    for i in range(ADAPTERS):
        source = serve_app.setups["llama"].adapter_dirs["demo-sql"]
        made = upload(serve_app, f"r{tag}-{i}", "public", source, "tiny-llama")
        assert made.status_code == 201, made.text
        names.append(f"public/r{tag}-{i}")
    yield key, names
    serve_app.deploy_default()


@pytest.mark.slow
def test_each_adapter_lives_on_one_replica_and_meets_its_requests_there(
    serve_app: ServeApp, adapters: tuple[str, list[str]]
) -> None:
    key, names = adapters
    deploy(serve_app, "adapter_aware")
    ours = workload(serve_app, key, names)
    print("routing", json.dumps({"ours": _summary(ours)}))

    assert ours["all"].requests == ADAPTERS * 5
    # Concurrent first requests agreed on one replica, and later bursts found the adapter there.
    spread = ours["all"].replicas_per_adapter
    assert len(spread) == ADAPTERS and all(len(where) == 1 for where in spread.values()), spread
    assert len({next(iter(where)) for where in spread.values()}) == REPLICAS  # the adapters are spread out
    assert ours["after"].hits >= 0.95 * ours["after"].requests


def _summary(run: dict[str, RoutingDelta]) -> dict[str, Any]:
    after = run["after"]
    return {
        "hit_rate_after_warm_up": after.hits / max(1, after.requests),
        "loads": run["all"].loads,
    }


def engine_replica_actors() -> list[dict[str, Any]]:
    return [a for a in ray.util.list_named_actors(all_namespaces=True) if "#engine-tiny-llama#" in a["name"]]


async def mixed_burst(app: ServeApp, key: str, names: list[str]) -> list[dict[str, Any]]:
    """Streamed and not, long enough (24 tokens) that some are mid-generation when a replica dies."""
    async with httpx.AsyncClient(
        base_url=app.url, timeout=120, headers={"authorization": f"Bearer {key}"}
    ) as c:

        async def one(i: int) -> dict[str, Any]:
            body: dict[str, Any] = {"model": names[i % len(names)], "prompt": f"row {i}", "max_tokens": 24}
            if i % 2:
                r = await c.post("/v1/completions", json=body)
                return {"id": r.json().get("id"), "status": r.status_code, "body": r.json(), "stream": False}
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                lines = [line[6:] async for line in r.aiter_lines() if line.startswith("data: {")]
            events = [json.loads(line) for line in lines]
            # A stream lost before any output (every failover attempt lost too) is its error event alone.
            ids = [event["id"] for event in events if "id" in event]
            return {"id": ids[0] if ids else None, "status": r.status_code, "events": events, "stream": True}

        return await asyncio.gather(*(one(i) for i in range(len(names) * 2)))


def eos_token_ids(app: ServeApp) -> list[int]:
    config = json.loads((app.setups["llama"].model_dir / "config.json").read_text())
    eos = config["eos_token_id"]
    return eos if isinstance(eos, list) else [eos]


async def burst_with_a_kill(
    app: ServeApp, key: str, names: list[str], victim: dict[str, Any]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A long stream of names[0] (on the victim: its adapter lives there) and, once that stream has output,
    a mixed burst over every adapter; the victim is killed while both are in flight."""
    async with httpx.AsyncClient(
        base_url=app.url, timeout=120, headers={"authorization": f"Bearer {key}"}
    ) as c:
        streaming = asyncio.Event()

        async def doomed() -> dict[str, Any]:
            # No end-of-sequence token: the stream cannot finish between the kill and its taking effect
            # (a random model sampling one early made this test fail on fast machines).
            no_eos = {str(token): -100 for token in eos_token_ids(app)}
            body = {"model": names[0], "prompt": "a long one", "max_tokens": 900, "stream": True,
                    "logit_bias": no_eos}  # fmt: skip
            events = []
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        streaming.set()
            return {"id": events[0]["id"], "status": r.status_code, "events": events, "stream": True}

        long_stream = asyncio.create_task(doomed())
        await asyncio.wait_for(streaming.wait(), 60)
        burst = asyncio.create_task(mixed_burst(app, key, names))
        await asyncio.sleep(0.3)  # the burst is in flight too
        actor = ray.get_actor(victim["name"], namespace=victim["namespace"])
        await asyncio.to_thread(ray.kill, actor)
        assert not long_stream.done(), "the long stream ended before the kill: nothing was lost"
        return await long_stream, await burst


@pytest.mark.slow
def test_a_replica_killed_mid_burst(serve_app: ServeApp, adapters: tuple[str, list[str]]) -> None:
    _, names = adapters
    tenant_id, key = serve_app.new_tenant(f"kill-{uuid.uuid4().hex[:8]}", tier="enterprise")
    deploy(serve_app, "adapter_aware")
    actors = engine_replica_actors()
    assert len(actors) == REPLICAS
    # The victim is the replica names[0] lives on: a request for it goes there (and loads it, if needed).
    with httpx.Client(base_url=serve_app.url, headers={"authorization": f"Bearer {key}"}, timeout=60) as c:
        warm = c.post("/v1/completions", json={"model": names[0], "prompt": "warm", "max_tokens": 2})
    assert warm.status_code == 200, warm.text
    killed = usage_rows(serve_app, tenant_id, [warm.json()["id"]])[warm.json()["id"]].replica
    assert killed is not None
    victim = next(a for a in actors if a["name"].endswith(f"#{killed.split(':', 1)[1]}"))

    long_stream, during = asyncio.run(burst_with_a_kill(serve_app, key, names, victim))

    # The kill took effect: the stream on the victim ended with the clear error, and Serve replaced it.
    assert long_stream["status"] == 200 and "error" in long_stream["events"][-1], long_stream["events"][-1]
    lost = 1
    assert long_stream["events"][-1]["error"]["code"] == "engine_unavailable"
    for answer in during:
        if answer["stream"]:  # an error event after partial output, or the whole completion
            assert answer["status"] == 200 and answer["events"]
            last = answer["events"][-1]
            if "error" in last:
                lost += 1
                assert last["error"]["code"] == "engine_unavailable", last
                assert "retry the request" in last["error"]["message"]
        elif answer["status"] != 200:  # restarted and lost each time: a clear 503
            lost += 1
            assert answer["status"] == 503 and answer["body"]["error"]["code"] == "engine_unavailable"
    assert lost < len(during)  # most requests were elsewhere or failed over
    deadline = time.monotonic() + 60
    while victim["name"] in {a["name"] for a in engine_replica_actors()} or len(engine_replica_actors()) < 3:
        assert time.monotonic() < deadline, "Serve did not replace the killed replica"
        time.sleep(0.5)

    after = asyncio.run(mixed_burst(serve_app, key, names))  # the router has stopped choosing it
    assert all(a["status"] == 200 and "error" not in (a.get("events") or [{}])[-1] for a in after)

    answered = [a["id"] for a in [long_stream, *during, *after] if a["id"] is not None]  # all but the 503s
    by_id = usage_rows(serve_app, tenant_id, answered)
    # Every request that reached an engine is metered, once (the table's key forbids doubles): answered
    # ones, and lost ones as failed; the lost stream on the victim among them.
    with sessions(serve_app)() as session:
        rows = list(session.scalars(select(UsageEvent).where(UsageEvent.tenant_id == tenant_id)))
    assert len(rows) <= 1 + len(during) + 1 + len(after)
    assert all(r.status in ("completed", "failed") for r in rows)
    assert len([r for r in rows if r.status == "failed"]) == lost
    assert by_id[long_stream["id"]].status == "failed" and by_id[long_stream["id"]].replica == killed
    assert all(by_id[a["id"]].replica != killed for a in after)
    assert {by_id[a["id"]].status for a in after} == {"completed"}


def usage_rows(app: ServeApp, tenant_id: str, ids: list[str], timeout: float = 60.0) -> dict[str, UsageEvent]:
    deadline = time.monotonic() + timeout
    while True:
        with sessions(app)() as session:
            rows = list(session.scalars(select(UsageEvent).where(UsageEvent.tenant_id == tenant_id)))
        by_id = {r.request_id: r for r in rows}
        if set(ids) <= by_id.keys():
            return by_id
        assert time.monotonic() < deadline, f"usage rows missing: {set(ids) - by_id.keys()}"
        time.sleep(0.5)
