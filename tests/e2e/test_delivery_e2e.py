"""A stream keeps its tenant's concurrency slot until Serve's proxy has written it out (issue 35, item 6),
and gives it back then: through the real proxy, a client that streams one request after another on a
tier of one concurrent request is never refused for concurrency."""

import asyncio
import uuid

import httpx
import pytest

from billing.models import Tier
from tests.e2e.conftest import ServeApp, sse_events


@pytest.mark.slow
def test_streams_one_after_another_on_a_tier_of_one(serve_app: ServeApp) -> None:
    tier = f"one-{uuid.uuid4().hex[:8]}"
    with serve_app.sessions()() as session, session.begin():
        session.add(Tier(name=tier, description="e2e", max_concurrent=1, on_limit="reject"))
    _, key = serve_app.new_tenant(f"seq-{uuid.uuid4().hex[:8]}", tier=tier)

    async def one_after_another() -> list[list[dict[str, object]]]:
        async with httpx.AsyncClient(base_url=serve_app.url, timeout=120,
                                     headers={"authorization": f"Bearer {key}"}) as client:  # fmt: skip
            body = {"model": "tiny-llama", "prompt": "one", "max_tokens": 8, "stream": True}
            return [await sse_events(client, body) for _ in range(6)]

    streams = asyncio.run(one_after_another())
    assert all(events and "error" not in events[-1] for events in streams)
