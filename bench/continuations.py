"""Continuations and validation on the ingress's event loop (issue 35, item 2): a `/v1/responses` request
that continues a long stored chain with `truncation: "auto"`, and a chat body of 63k short messages that
must be refused. Counts what the ingress does (messages templated per request) and times it, in process
(the full HTTP app over an engine that answers at once), so only the ingress's own work is measured.

A before/after comparison runs this file against two trees in turns (the file is copied beside the older
tree): `python -m bench.continuations --turns 500 --repeats 5`. The last line is one JSON object.
"""

import argparse
import asyncio
import json
import statistics
import time
import uuid
from typing import Any

import httpx

from app.auth.api_keys import generate_key
from app.bootstrap import build_services
from app.main import create_app
from app.responses.store import ResponseStore
from app.schemas.openai import ChatMessage
from app.served_models.catalog import BaseModelSpec
from app.served_models.prompts import PromptBuilder
from bench.gateway import LocalInstantClient, scratch_settings
from bench.measure import machine, spread
from billing import repository
from billing.db import make_engine, make_session_factory, session_scope

MODEL = "bench"


def chain_of(turns: int) -> list[dict[str, Any]]:
    """A stored conversation of `turns` user/assistant turns, three words each."""
    return [
        {"type": "message", "role": role, "content": f"{role[0]}{n} " * 3, "id": f"msg_{n}{role}"}
        for n in range(turns)
        for role in ("user", "assistant")
    ]


async def measure(turns: int, repeats: int) -> dict[str, Any]:
    settings, model_dir = scratch_settings("continuations-bench-")
    url = settings.database_url
    services = build_services(settings, LocalInstantClient(), {MODEL: BaseModelSpec(model_dir)})
    key = generate_key(services.key_secret)
    with session_scope(make_session_factory(make_engine(url))) as session:
        tenant = repository.create_tenant(session, name="bench", tier="enterprise")
        repository.create_api_key(session, tenant_id=tenant.id, prefix=key.prefix, key_hash=key.hash)
    store = ResponseStore(services.session_factory, settings.responses)
    app = create_app(services)
    headers = {"authorization": f"Bearer {key.plaintext}"}
    templated: list[int] = []
    chat = PromptBuilder.chat

    def counting(self: PromptBuilder, messages: list[ChatMessage], *args: Any) -> list[int]:
        templated.append(len(messages))
        return chat(self, messages, *args)

    PromptBuilder.chat = counting  # type: ignore[method-assign,assignment]  # a bench's spy, this process only
    flood = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 63_000}
    ms: dict[str, list[float]] = {"truncation_auto": [], "flood_refused": []}
    messages: list[int] = []
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://b", timeout=300) as http,
    ):
        for _ in range(repeats):  # the two in turns, so drift affects both alike
            response_id = f"resp_bench{uuid.uuid4().hex}"
            stored: dict[str, Any] = {"id": response_id, "model": MODEL, "output": [], "store": True}
            store.save(tenant.id, {**stored, "previous_response_id": None}, chain_of(turns), [])
            continuation = {"model": MODEL, "input": "and now?", "previous_response_id": response_id,
                            "truncation": "auto", "max_output_tokens": 256}  # fmt: skip
            templated.clear()
            start = time.perf_counter()
            r = await http.post("/v1/responses", json=continuation, headers=headers)
            ms["truncation_auto"].append((time.perf_counter() - start) * 1e3)
            assert r.status_code == 200, r.text
            messages.append(sum(templated))
            start = time.perf_counter()
            r = await http.post("/v1/chat/completions", json=flood, headers=headers)
            ms["flood_refused"].append((time.perf_counter() - start) * 1e3)
            assert r.status_code == 400, r.text
    return {
        "bench": "continuations",
        "turns": turns,
        "repeats": repeats,
        "truncation_auto_ms": round(statistics.median(ms["truncation_auto"]), 1),
        "truncation_auto_ms_spread": spread(ms["truncation_auto"]),
        "messages_templated": statistics.median(messages),
        "flood_refused_ms": round(statistics.median(ms["flood_refused"]), 1),
        "flood_refused_ms_spread": spread(ms["flood_refused"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=500, help="turns in the stored chain")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="a 50-turn chain, once: checks the bench runs")
    args = parser.parse_args()
    if args.tiny:
        args.turns, args.repeats = 50, 1
    result = asyncio.run(measure(args.turns, args.repeats))
    result["machine"] = machine()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
