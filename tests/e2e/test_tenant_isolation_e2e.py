"""Two tenants on one engine replica through the Serve app: a tenant's backlog does not make another wait
behind all of it (the engine's fair admission), and the admin view shows both tenants as the replica
reports them. Order, not time: the quiet tenant's answer must end before the backlog's last request even
starts, which first-come-first-served would never allow."""

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import ServeApp, sse_events
from tests.e2e.test_routing_policy_e2e import deploy

BACKLOG = 8  # requests of the busy tenant, four times the replica's rows
ROWS = 2


@pytest.fixture(scope="module")
def restore(serve_app: ServeApp) -> Iterator[None]:
    yield
    serve_app.deploy_default()


def waiting_of(serve_app: ServeApp, tenant_id: str) -> int:
    with serve_app.admin() as admin:
        shown = admin.get("/admin/engines", params={"model": "tiny-llama"})
    assert shown.status_code == 200, shown.text
    replicas = shown.json()["data"]
    return sum(t["waiting"] for r in replicas for t in r["tenants"] if t["tenant_id"] == tenant_id)


@pytest.mark.slow
@pytest.mark.usefixtures("restore")
def test_a_quiet_tenant_is_served_before_a_busy_tenants_backlog_drains(serve_app: ServeApp) -> None:
    deploy(serve_app, 1, engine={"max_num_seqs": ROWS})
    busy_id, busy_key = serve_app.new_tenant(f"busy-{uuid.uuid4().hex[:8]}", tier="enterprise")
    quiet_id, quiet_key = serve_app.new_tenant(f"quiet-{uuid.uuid4().hex[:8]}", tier="enterprise")

    async def run() -> tuple[list[float | None], list[dict[str, Any]], float]:
        first_token: list[float | None] = [None] * BACKLOG
        async with httpx.AsyncClient(base_url=serve_app.url, timeout=300) as client:

            async def busy(i: int) -> list[dict[str, Any]]:
                busy_client = httpx.AsyncClient(base_url=serve_app.url, timeout=300,
                                                headers={"authorization": f"Bearer {busy_key}"})  # fmt: skip

                def seen() -> None:
                    if first_token[i] is None:
                        first_token[i] = time.monotonic()

                body = {"model": "tiny-llama", "prompt": f"backlog {i}", "max_tokens": 300, "temperature": 0,
                        "stream": True, "ignore_eos": True}  # fmt: skip
                async with busy_client:
                    return await sse_events(busy_client, body, seen)

            backlog = [asyncio.create_task(busy(i)) for i in range(BACKLOG)]
            # The backlog queues in the engine before the quiet tenant asks (the replica reports it). Half of
            # it waiting is enough (the order below needs one): on a loaded machine the ingress may pass the
            # eight on slowly enough that the first two end before the last arrives (a full run once never
            # saw six waiting at once).
            deadline = time.monotonic() + 120
            while await asyncio.to_thread(waiting_of, serve_app, busy_id) < BACKLOG // 2:
                assert time.monotonic() < deadline, "the busy tenant's backlog never queued"
                await asyncio.sleep(0.25)
            quiet = await client.post(
                "/v1/completions",
                headers={"authorization": f"Bearer {quiet_key}"},
                json={"model": "tiny-llama", "prompt": "a quick one", "max_tokens": 5, "temperature": 0},
            )
            quiet_done = time.monotonic()
            assert quiet.status_code == 200, quiet.text
            streams = await asyncio.gather(*backlog)
        return first_token, [events[-1] for events in streams], quiet_done

    first_token, last_events, quiet_done = asyncio.run(run())
    assert all("error" not in event for event in last_events), last_events
    assert all(t is not None for t in first_token)  # every request of the backlog was served in the end
    # First come, first served would have started all eight before the quiet tenant's request.
    assert quiet_done < max(t for t in first_token if t is not None)
    with serve_app.admin() as admin:
        shown = admin.get("/admin/engines", params={"model": "tiny-llama"}).json()["data"]
    served = {t["tenant_id"]: t["service"] for r in shown for t in r["tenants"]}
    assert served.get(busy_id, 0) > served.get(quiet_id, 0) > 0
