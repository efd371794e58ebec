"""Metering on Ray Serve: every request id billed exactly once with the right counts, through faults (the
Metering replica killed mid-burst, the database locked for a while, a batch delivered twice), and the GPU
time billed to requests adds up to the engine's measured busy time."""

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import ray
from ray import serve
from sqlalchemy import select

from billing.models import EngineReport, UsageEvent
from billing.usage import UsageRecord
from tests.e2e.conftest import APP_NAME, ServeApp, engine_settings, in_background, sse_events


@pytest.fixture(scope="module")
def fresh_app(serve_app: ServeApp) -> Iterator[ServeApp]:
    """New engine replicas (a config change), so their busy time is this module's alone."""
    engine = engine_settings(serve_app.setups["llama"], max_num_seqs=15)
    serve_app.deploy({"models": [{"name": "tiny-llama", "engine": engine}]})
    yield serve_app
    serve_app.deploy_default()


def sessions(app: ServeApp) -> Any:
    return app.sessions()


def rows_for(app: ServeApp, ids: list[str]) -> list[UsageEvent]:
    with sessions(app)() as session:
        return list(session.scalars(select(UsageEvent).where(UsageEvent.request_id.in_(ids))))


def wait_for_rows(app: ServeApp, ids: list[str], timeout: float = 90.0) -> list[UsageEvent]:
    deadline = time.monotonic() + timeout
    while len(rows := rows_for(app, ids)) < len(ids):
        assert time.monotonic() < deadline, f"{len(rows)} of {len(ids)} usage rows"
        time.sleep(0.25)
    return rows


async def send(url: str, key: str, n: int, *, stream_every: int = 3) -> list[dict[str, Any]]:
    """n requests, every third streamed with include_usage; returns each response's id and usage."""
    async with httpx.AsyncClient(base_url=url, timeout=120, headers={"authorization": f"Bearer {key}"}) as c:

        async def one(i: int) -> dict[str, Any]:
            body: dict[str, Any] = {"model": "tiny-llama", "prompt": f"number {i}", "max_tokens": 3 + i % 5}
            if i % stream_every:
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return {"id": r.json()["id"], "usage": r.json()["usage"]}
            body.update(stream=True, stream_options={"include_usage": True})
            async with c.stream("POST", "/v1/completions", json=body) as r:
                chunks = [line[6:] async for line in r.aiter_lines() if line.startswith("data: {")]
            parsed = [json.loads(chunk) for chunk in chunks]
            return {"id": parsed[0]["id"], "usage": parsed[-1]["usage"]}

        return await asyncio.gather(*(one(i) for i in range(n)))


def check_exactly_once(app: ServeApp, sent: list[dict[str, Any]]) -> None:
    ids = [s["id"] for s in sent]
    assert len(set(ids)) == len(ids)
    rows = {r.request_id: r for r in wait_for_rows(app, ids)}
    assert sorted(rows) == sorted(ids)  # a row per request: none missing, the key forbids doubles
    for s in sent:
        row = rows[s["id"]]
        usage = s["usage"]
        assert (row.prompt_tokens, row.completion_tokens) == (
            usage["prompt_tokens"],
            usage["completion_tokens"],
        )


def metering_actor() -> dict[str, Any]:
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "#metering#" in a["name"]]
    assert len(names) == 1, names
    actor: dict[str, Any] = names[0]
    return actor


async def metering_stats() -> dict[str, int]:
    stats: dict[str, int] = await serve.get_deployment_handle("metering", app_name=APP_NAME).stats.remote()
    return stats


@pytest.mark.slow
def test_gpu_time_billed_adds_up_to_the_engines_busy_time(fresh_app: ServeApp) -> None:
    _, key = fresh_app.new_tenant(f"gpu-{uuid.uuid4().hex[:8]}", tier="enterprise")
    sent = asyncio.run(send(fresh_app.url, key, 30))
    check_exactly_once(fresh_app, sent)
    fresh_app.engine_handle("tiny-llama").report_now.remote().result()
    # The module's own replica (fresh: it has served these requests and nothing else yet).
    ours = {row.replica for row in rows_for(fresh_app, [s["id"] for s in sent])}
    with sessions(fresh_app)() as session:
        reports = list(session.scalars(select(EngineReport).where(EngineReport.replica.in_(ours))))
        replicas = {r.replica: r for r in reports}
        billed: dict[str, float] = {}
        for row in session.scalars(select(UsageEvent).where(UsageEvent.replica.in_(list(replicas)))):
            billed[row.replica or ""] = billed.get(row.replica or "", 0.0) + row.gpu_ms
    busy = {name: replicas[name].busy_ms for name in billed}
    assert billed and billed.keys() == ours, "no request was attributed to a reporting replica"
    for name, total in billed.items():
        assert total == pytest.approx(busy[name], rel=0.01), name  # shares of each step add up to the step


@pytest.mark.slow
def test_exactly_once_through_a_killed_metering_replica(fresh_app: ServeApp) -> None:
    _, key = fresh_app.new_tenant(f"kill-{uuid.uuid4().hex[:8]}", tier="enterprise")
    victim = metering_actor()

    def kill() -> None:
        ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=False)

    killed = in_background(0.5, kill)
    sent = asyncio.run(send(fresh_app.url, key, 40))
    killed.result(timeout=60)  # the kill happened (or its error fails the test)
    check_exactly_once(fresh_app, sent)
    assert metering_actor()["name"] != victim["name"]  # Serve replaced the killed replica


async def streams_through_an_outage(app: ServeApp, key: str, n: int) -> tuple[list[dict[str, Any]], int]:
    """n long streams start; once every one has output, the database goes away; they finish during the
    outage, so their usage cannot reach the database until it is back. Returns what the client saw and
    how many metering batches failed during the outage."""
    async with httpx.AsyncClient(
        base_url=app.url, timeout=120, headers={"authorization": f"Bearer {key}"}
    ) as c:
        started = [asyncio.Event() for _ in range(n)]

        async def one(i: int) -> dict[str, Any]:
            body = {"model": "tiny-llama", "prompt": f"story {i}", "max_tokens": 200, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            events = await sse_events(c, body, started[i].set)
            return {"id": events[0]["id"], "usage": events[-1]["usage"]}

        streams = [asyncio.create_task(one(i)) for i in range(n)]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
        failed_before = (await metering_stats())["failed_batches"]
        with app.database_outage():
            sent = await asyncio.gather(*streams)
            deadline = time.monotonic() + 60
            while (failed := (await metering_stats())["failed_batches"] - failed_before) == 0:
                assert time.monotonic() < deadline, "no delivery failed: the outage never bit"
                await asyncio.sleep(0.25)
        return sent, failed


@pytest.mark.slow
def test_exactly_once_through_a_database_outage(fresh_app: ServeApp) -> None:
    _, key = fresh_app.new_tenant(f"db-{uuid.uuid4().hex[:8]}", tier="enterprise")
    sent, failed = asyncio.run(streams_through_an_outage(fresh_app, key, 8))
    assert failed > 0  # a delivery was refused while the database was away
    check_exactly_once(fresh_app, sent)  # and once it was back, every record landed once


@pytest.mark.slow
def test_the_same_batch_delivered_twice_counts_once(fresh_app: ServeApp) -> None:
    _, key = fresh_app.new_tenant(f"dup-{uuid.uuid4().hex[:8]}", tier="enterprise")
    sent = asyncio.run(send(fresh_app.url, key, 5))
    rows = wait_for_rows(fresh_app, [s["id"] for s in sent])
    batch = [UsageRecord(**{f: getattr(r, f) for f in UsageRecord.__dataclass_fields__}) for r in rows]
    handle = serve.get_deployment_handle("metering", app_name=APP_NAME)
    assert handle.record.remote(batch).result() == 0
    assert handle.record.remote(batch).result() == 0
    assert len(rows_for(fresh_app, [s["id"] for s in sent])) == 5
