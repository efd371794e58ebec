"""A GPU-time bound through the real HTTP API (issue 29): a budgeted tenant on a tier that prices GPU time
holds budget_max_gpu_seconds of it at admission, the engine stops the request there (finish_reason
"length", gpu_time_limited), and the settled cost, GPU time included, is within the hold and spent in full:
the balance is the credit less the usage rows' costs."""

import json
import uuid
from collections.abc import Iterator
from decimal import Decimal

import httpx
import pytest
from sqlalchemy import select

from billing.models import UsageEvent
from billing.price_book import Metered, cost_of, worst_case
from billing.pricing import Prices
from tests.app.conftest import MODEL, Served, serving
from tests.app.helpers import wait_for
from tests.app.test_budgets_api import limits, top_up
from tests.model_fixtures import TinySetup

GPU_S = 0.003  # 3 ms of GPU time a request: a few steps of the tiny model, far fewer than 200 tokens
PRICES = Prices(tier="gpu-priced", currency="usd", input_per_mtok=Decimal(100),
                cached_input_per_mtok=Decimal(100), output_per_mtok=Decimal(200),
                gpu_per_second=Decimal(10))  # fmt: skip
GPU_PART = Decimal("0.03")  # 3 ms at 10 a second


@pytest.fixture(scope="module")
def served(llama: TinySetup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(llama, tmp_path_factory.mktemp("gpu-bound"), budget_max_gpu_seconds=GPU_S) as app:
        with app.admin() as admin:
            body = {"name": PRICES.tier, "price_input_per_mtok": "100", "price_cached_input_per_mtok": "100",
                    "price_output_per_mtok": "200", "price_gpu_per_second": "10"}  # fmt: skip
            assert admin.post("/admin/tiers", json=body).status_code == 201
        yield app


def prepaid(served: Served, amount: str) -> tuple[str, str]:
    tenant_id, key = served.new_tenant(f"g-{uuid.uuid4().hex[:8]}", tier=PRICES.tier)
    assert top_up(served, tenant_id, amount).status_code == 201
    wait_for(lambda: limits(served, key).json()["budget"]["prepaid"] is True)  # the cached principal knows
    return tenant_id, key


def chat(served: Served, key: str, max_tokens: int, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}  # fmt: skip
    return httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {key}"})  # fmt: skip


def rows(served: Served, tenant_id: str) -> list[UsageEvent]:
    with served.services.session_factory() as session:
        return list(session.scalars(select(UsageEvent).where(UsageEvent.tenant_id == tenant_id)))


def test_the_engine_stops_at_the_bound_and_the_cost_stays_within_the_hold(served: Served) -> None:
    tenant_id, key = prepaid(served, "1")
    reply = chat(served, key, max_tokens=200)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    choice, usage = body["choices"][0], body["usage"]
    assert choice["finish_reason"] == "length" and choice["gpu_time_limited"] is True
    assert usage["completion_tokens"] < 200  # stopped by its GPU time, not its max_tokens

    streamed = chat(served, key, max_tokens=200, stream=True)
    assert streamed.status_code == 200
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    last = [c["choices"][-1] for c in chunks if c["choices"] and c["choices"][-1].get("finish_reason")]
    assert last == [{**last[0], "finish_reason": "length", "gpu_time_limited": True}]

    wait_for(lambda: len(rows(served, tenant_id)) == 2)
    for row in rows(served, tenant_id):
        assert 0 < row.gpu_ms <= GPU_S * 1000  # the engine charges at most the bound
        used = Metered(row.prompt_tokens, row.cached_tokens, row.completion_tokens, row.gpu_ms)
        assert row.cost is not None and Decimal(str(row.cost)) == cost_of(used, PRICES)
        held = worst_case(row.prompt_tokens, 200, PRICES, GPU_S * 1000)  # what admission held
        assert Decimal(str(row.cost)) <= held
    spent = sum(Decimal(str(row.cost)) for row in rows(served, tenant_id))
    shown = limits(served, key).json()["budget"]
    assert Decimal(shown["balance"]) == Decimal(1) - spent and shown["reserved"] == "0.000000"


def test_credit_for_the_tokens_but_not_the_gpu_bound_is_refused(served: Served) -> None:
    tenant_id, key = prepaid(served, "0.01")  # the tokens of one short reply fit; 0.03 of GPU time not
    refused = chat(served, key, max_tokens=1)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "insufficient_quota" and "prepaid credit" in error["message"]
    needed = Decimal(error["message"].split("may cost up to ")[1].split()[0])
    assert GPU_PART < needed < Decimal("0.01") + GPU_PART
    assert rows(served, tenant_id) == []  # refused before any work


def responses(served: Served, key: str, max_output_tokens: int, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": max_output_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream, "store": False}  # fmt: skip
    return httpx.post(f"{served.url}/v1/responses", json=body, timeout=60,
                      headers={"authorization": f"Bearer {key}"})  # fmt: skip


def test_a_response_stopped_at_the_bound_says_so_as_chat_does(served: Served) -> None:
    """Issue 35, item 8e: /v1/responses ended a GPU-bounded response as if max_output_tokens had cut it.
    It is incomplete (the output was cut by a limit, as chat's finish_reason "length"), and its
    incomplete_details say gpu_time_limited, as chat's choice does; a max_output_tokens cut does not."""
    _, key = prepaid(served, "1")
    reply = responses(served, key, max_output_tokens=200)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["status"] == "incomplete" and body["usage"]["output_tokens"] < 200
    assert body["incomplete_details"] == {"reason": "max_output_tokens", "gpu_time_limited": True}

    streamed = responses(served, key, max_output_tokens=200, stream=True)
    assert streamed.status_code == 200
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    ended = [e["response"] for e in events if e["type"] in ("response.completed", "response.incomplete")]
    assert [(r["status"], r["incomplete_details"]) for r in ended] == [
        ("incomplete", {"reason": "max_output_tokens", "gpu_time_limited": True})
    ]

    short = responses(served, key, max_output_tokens=1).json()  # cut by its own limit, not the GPU's
    assert short["status"] == "incomplete" and short["incomplete_details"] == {"reason": "max_output_tokens"}
