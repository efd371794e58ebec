"""The adapter-aware router's policies on real Serve replicas, each shown to change where requests go:
a hot adapter spills past its overloaded home (queue lengths and reported load), follow-up turns of a
conversation return to the replica that holds their prefix (on_request_routed's memory), and a replica
removed by a scale-down (or a rolling update) finishes its streams first, the ingress's too (drain)."""

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from ray import serve
from sqlalchemy import select

from billing.models import UsageEvent
from deployments.builder import build_app
from tests.e2e.conftest import APP_NAME, ServeApp, engine_settings, serve_status_wait, sse_events
from tests.e2e.test_adapters_e2e import upload
from tests.e2e.test_routing_e2e import engine_replica_actors, wait_for_replicas


def deploy(app: ServeApp, replicas: int, **options: Any) -> None:
    engine = engine_settings(app.setups["llama"], **{"max_num_seqs": 4, **options.pop("engine", {})})
    model = {"name": "tiny-llama", "engine": engine, "num_replicas": replicas, "report_interval_s": 0.5}
    app.deploy({"models": [{**model, **options}]})
    wait_for_replicas(app, replicas)


@pytest.fixture(scope="module")
def restore(serve_app: ServeApp) -> Iterator[None]:
    """The usual app back once, after the module: each test deploys its own shape first (a redeploy ~15 s)."""
    yield
    serve_app.deploy_default()


def rows(app: ServeApp, ids: list[str], timeout: float = 60.0) -> dict[str, UsageEvent]:
    deadline = time.monotonic() + timeout
    while True:
        with app.sessions()() as session:
            found = {
                r.request_id: r
                for r in session.scalars(select(UsageEvent).where(UsageEvent.request_id.in_(ids)))
            }
        if len(found) == len(ids):
            return found
        assert time.monotonic() < deadline, f"{len(found)} of {len(ids)} usage rows"
        time.sleep(0.25)


@pytest.mark.slow
@pytest.mark.usefixtures("restore")
def test_a_hot_adapter_spills_past_its_overloaded_home(serve_app: ServeApp) -> None:
    # Overloaded at running + waiting >= 0.5 * 4 = 2: a sustained burst of one adapter cannot all stay home.
    deploy(serve_app, 2, spill_factor=0.5)
    made = upload(serve_app, f"hot-{uuid.uuid4().hex[:6]}", "public", serve_app.setups["llama"].adapter_dirs[
        "demo-sql"], "tiny-llama")  # fmt: skip
    assert made.status_code == 201, made.text
    _, key = serve_app.new_tenant(f"spill-{uuid.uuid4().hex[:8]}", tier="enterprise")
    model = f"public/{made.json()['name']}"

    async def burst() -> list[str]:
        async with httpx.AsyncClient(base_url=serve_app.url, timeout=120,
                                     headers={"authorization": f"Bearer {key}"}) as c:  # fmt: skip
            first = await c.post("/v1/completions", json={"model": model, "prompt": "warm", "max_tokens": 2})
            assert first.status_code == 200, first.text
            body = {"model": model, "prompt": "select", "max_tokens": 150, "temperature": 0}
            answers = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(12)))
        assert [a.status_code for a in answers] == [200] * 12, [a.text for a in answers if a.is_error]
        return [first.json()["id"], *(a.json()["id"] for a in answers)]

    ids = asyncio.run(burst())
    served = rows(serve_app, ids)
    home = served[ids[0]].replica  # the warm-up request went to the adapter's home
    burst_replicas = [served[i].replica for i in ids[1:]]
    assert set(burst_replicas) == {r.replica for r in served.values()} and len(set(burst_replicas)) == 2
    assert burst_replicas.count(home) >= 2  # the home took its share before it counted as overloaded


@pytest.mark.slow
@pytest.mark.usefixtures("restore")
def test_follow_up_turns_return_to_the_replica_holding_their_prefix(serve_app: ServeApp) -> None:
    _, key = serve_app.new_tenant(f"turns-{uuid.uuid4().hex[:8]}", tier="enterprise")
    # Traffic just before the scale-up leaves the ingress's router a fresh queue length (Serve keeps it 10 s)
    # for the old replica only; where the scale-up is quicker than that, a router that listed the old replica
    # beside the new ones sent the whole burst below to it (tests/routing/test_router_policy.py has the rule).
    warm = {"model": "tiny-llama", "prompt": "Low tide", "max_tokens": 2}
    assert httpx.post(f"{serve_app.url}/v1/completions", json=warm, timeout=60,
                      headers={"authorization": f"Bearer {key}"}).status_code == 200  # fmt: skip
    deploy(serve_app, 3)
    conversations = [
        [
            {
                "role": "system",
                "content": f"Conversation {i}: you answer questions about tide tables, "
                f"harbour depths and the moon, in that order, briefly.",
            },
            {"role": "user", "content": "When is high tide?"},
        ]
        for i in range(6)
    ]

    async def turns() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with httpx.AsyncClient(base_url=serve_app.url, timeout=120,
                                     headers={"authorization": f"Bearer {key}"}) as c:  # fmt: skip

            async def ask(messages: list[dict[str, str]]) -> dict[str, Any]:
                body = {"model": "tiny-llama", "messages": messages, "max_tokens": 40, "temperature": 0}
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return dict(r.json())

            # First turns at once, so that load spreads them over the replicas.
            first = await asyncio.gather(*(ask(m) for m in conversations))
            follow = [
                [*m, {"role": "assistant", "content": f["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And the moon?"}]
                for m, f in zip(conversations, first, strict=True)
            ]  # fmt: skip
            second = [await ask(m) for m in follow]  # one at a time: load alone would pick one replica
            return first, second

    first, second = asyncio.run(turns())
    served = rows(serve_app, [r["id"] for r in first + second])
    first_replicas = [served[r["id"]].replica for r in first]
    assert len(set(first_replicas)) >= 2, first_replicas  # the conversations really live on several
    for one, two in zip(first, second, strict=True):
        assert served[two["id"]].replica == served[one["id"]].replica
        assert two["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its prefix's KV was reused


# Far above the drain itself (~45 s alone). With 120 s, CI (two loaded workers) once saw a queued stream
# get a 500: most likely five 900-token streams in a row outlasted the grace period and Serve force-killed
# the replica and the ingress (which drains as long). The test is about finishing streams, not speed.
DRAIN_S = 600


@pytest.mark.slow
@pytest.mark.usefixtures("restore")
def test_a_scaled_down_replica_finishes_its_streams_first(serve_app: ServeApp) -> None:
    # One sequence at a time per replica, so three long streams queue up on each: seconds of work left on
    # the replica the scale-down removes, whose running and queued streams must all end normally.
    deploy(serve_app, 2, engine={"max_num_seqs": 1}, drain_timeout_s=DRAIN_S)
    _, key = serve_app.new_tenant(f"drain-{uuid.uuid4().hex[:8]}", tier="enterprise")
    before = {a["name"] for a in engine_replica_actors()}
    streams = 10  # five in a row on each replica: well over the time Serve takes to start replacing them

    async def streams_across_a_scale_down() -> tuple[list[list[dict[str, Any]]], list[float], float]:
        async with httpx.AsyncClient(base_url=serve_app.url, timeout=300,
                                     headers={"authorization": f"Bearer {key}"}) as c:  # fmt: skip
            started = asyncio.Event()
            ended = [0.0] * streams

            async def stream(i: int) -> list[dict[str, Any]]:
                body = {"model": "tiny-llama", "prompt": f"drain {i}", "max_tokens": 900, "temperature": 0,
                        "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
                events = await sse_events(c, body, started.set)
                ended[i] = time.monotonic()
                return events

            tasks = [asyncio.create_task(stream(i)) for i in range(streams)]
            await started.wait()
            engine = engine_settings(serve_app.setups["llama"], max_num_seqs=1)
            args = {"models": [{"name": "tiny-llama", "engine": engine, "num_replicas": 1,
                                "report_interval_s": 0.5, "drain_timeout_s": DRAIN_S}]}  # fmt: skip
            update = asyncio.create_task(
                asyncio.to_thread(serve.run, build_app(args), name=APP_NAME, route_prefix="/", blocking=False)
            )
            told_to_stop = await asyncio.to_thread(first_stopping_replica)
            results = list(await asyncio.gather(*tasks))
            await update
            return results, ended, told_to_stop

    results, ended, told_to_stop = asyncio.run(streams_across_a_scale_down())
    serve_status_wait()
    for events in results:
        assert "error" not in events[-1], events[-1]
        assert events[-2]["choices"][0]["finish_reason"] in ("length", "stop")  # ended as it should
        assert events[-1]["usage"]["completion_tokens"] > 0
    served = rows(serve_app, [events[0]["id"] for events in results])
    # A change of the app's args rolls its replicas (Serve derives the code version from them): every
    # replica that held these streams was removed, and at least one still streamed when told to stop.
    after = {a["name"] for a in engine_replica_actors()}
    assert len(after) == 1
    removed = {f"tiny-llama:{name.rsplit('#', 1)[-1]}" for name in before - after}
    on_removed = [i for i, events in enumerate(results) if served[events[0]["id"]].replica in removed]
    assert on_removed, "no stream ran on a replica that was removed"
    assert max(ended[i] for i in on_removed) > told_to_stop, "every stream ended before any replica drained"


def first_stopping_replica(timeout_s: float = 120.0) -> float:
    """When the first engine replica entered STOPPING (Serve is draining it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get(APP_NAME)
        deployment = None if app is None else app.deployments.get("engine-tiny-llama")
        states = {} if deployment is None else deployment.replica_states
        if any(getattr(state, "value", state) == "STOPPING" and n for state, n in states.items()):
            return time.monotonic()
        time.sleep(0.1)
    raise AssertionError("no engine replica was ever told to stop")
