"""Continuations and validation that cost work linear in what is sent (issue 35, item 2): chat `messages`
and Responses `input` are counted before any item is validated; an output budget past the context is refused
before a turn is read; truncation 'auto' templates the chain once whole and cuts it by arithmetic, and the
storage bound serialises each item once. Work is counted (templated messages, serialised characters), never
timed."""

import json
import uuid
from typing import Any

import httpx
import pytest

from app.responses.conversation import Conversation, with_ids
from app.responses.request import ResponseRequest
from app.responses.routes import _within_storage
from app.responses.store import ResponseStore
from app.schemas.openai import ChatMessage
from app.served_models.prompts import PromptBuilder
from app.settings import ResponsesConfig, Settings
from tests.app.conftest import MODEL, Served
from tests.app.test_error_contract import assert_error

CONTEXT = 1024  # the tiny model's
BOUND = 4096  # MAX_MESSAGES and MAX_INPUT_ITEMS, as README states them


@pytest.fixture(scope="module")
def tenant(served: Served) -> tuple[str, str]:
    return served.new_tenant(f"conv-bounds-{uuid.uuid4().hex[:8]}", tier="enterprise")


def post(served: Served, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    content = json.dumps(body, separators=(",", ":")).encode()
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    return httpx.post(f"{served.url}{path}", headers=headers, content=content, timeout=120)


@pytest.fixture
def templated(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The messages of each templating (PromptBuilder.chat), as the app makes them."""
    calls: list[int] = []
    chat = PromptBuilder.chat

    def counting(self: PromptBuilder, messages: list[ChatMessage], *args: Any) -> list[int]:
        calls.append(len(messages))
        return chat(self, messages, *args)

    monkeypatch.setattr(PromptBuilder, "chat", counting)
    return calls


@pytest.mark.parametrize(
    ("path", "field"), [("/v1/chat/completions", "messages"), ("/v1/responses", "input")]
)
def test_a_list_past_the_schemas_bound_is_refused_by_its_count_before_any_item(
    served: Served, tenant: tuple[str, str], path: str, field: str
) -> None:
    """63k short items (the 2 MB body that validated for 0.55 s): one 400 naming the field, from its count;
    the invalid last item is never reached."""
    _, key = tenant
    items: list[dict[str, Any]] = [{"role": "user", "content": "hi"}] * 63_000
    items.append({"role": "nobody", "content": "hi"})
    r = post(served, key, path, {"model": MODEL, field: items})
    error = assert_error(r, 400, param=field)
    assert f"{field} has 63,001 items; at most {BOUND:,} are accepted" in error["message"], error


def seed(served: Served, tenant_id: str, turns: int, words: int = 1) -> str:
    """A stored response whose chain has `turns` user/assistant turns (as if continued that often)."""
    chain = [
        {
            "type": "message",
            "role": role,
            "content": " ".join([f"{role[0]}{n}"] * words),
            "id": f"msg_{n}{role}",
        }
        for n in range(turns)
        for role in ("user", "assistant")
    ]
    response_id = f"resp_seed{uuid.uuid4().hex}"
    body: dict[str, Any] = {
        "id": response_id,
        "model": MODEL,
        "output": [],
        "previous_response_id": None,
        "store": True,
    }
    ResponseStore(served.services.session_factory, served.services.settings.responses).save(
        tenant_id, body, chain, []
    )
    return response_id


def continuation(previous: str, budget: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "input": "and now?",
        "previous_response_id": previous,
        "truncation": "auto",
        "max_output_tokens": budget,
        "temperature": 0,
    }


def test_an_output_budget_past_the_context_is_refused_before_any_turn_is_templated(
    served: Served, tenant: tuple[str, str], templated: list[int]
) -> None:
    tenant_id, key = tenant
    previous = seed(served, tenant_id, 200)
    for budget in (2**20, CONTEXT):
        r = post(served, key, "/v1/responses", continuation(previous, budget))
        error = assert_error(r, 400, param="max_output_tokens")
        assert f"context of {CONTEXT:,} tokens" in error["message"], error
    assert templated == []  # dropping turn after turn templated the chain ~200 times first


def test_truncation_templates_the_chain_once_and_cuts_it_by_arithmetic(
    served: Served, tenant: tuple[str, str], templated: list[int]
) -> None:
    tenant_id, key = tenant
    turns = 300
    previous = seed(served, tenant_id, turns, words=3)
    budget = 256
    r = post(served, key, "/v1/responses", continuation(previous, budget))
    assert r.status_code == 200, r.text
    messages = 2 * turns + 1
    # The whole chain once, the request's own items alone once, the cut chain once (and a turn more only
    # if the estimate fell short). Dropping a turn at a time templated ~messages² / 4 of them.
    assert len(templated) <= 4 and sum(templated) <= 2 * messages + 4, templated
    used = r.json()["usage"]["input_tokens"]
    assert used + budget <= CONTEXT
    assert used + budget > CONTEXT - 40, used  # no more dropped than needed: a turn here is ~14 tokens
    stored = ResponseStore(served.services.session_factory, served.services.settings.responses).get(
        tenant_id, r.json()["id"], chain=True
    )
    assert stored is not None and stored.context and stored.context[0]["role"] == "user"
    assert stored.context[-1]["id"] == f"msg_{turns - 1}assistant"  # the newest turns are the ones kept


def test_the_storage_bound_serialises_each_item_once(monkeypatch: pytest.MonkeyPatch) -> None:
    chain = [
        {"type": "message", "role": role, "content": "x" * 300, "id": f"msg_{n}_{role}"}
        for n in range(400)
        for role in ("user", "assistant")
    ]
    conversation = Conversation(chain, with_ids(ResponseRequest(model="m", input="now").items()))
    whole = conversation.size()
    serialised: list[int] = []
    dumps = json.dumps

    def counting(value: Any, **kwargs: Any) -> str:
        text = dumps(value, **kwargs)
        serialised.append(len(text))
        return text

    monkeypatch.setattr(json, "dumps", counting)
    settings = Settings(responses=ResponsesConfig(max_stored_kb=64))
    kept = _within_storage(settings, ResponseRequest(model="m", input="now", truncation="auto"), conversation)
    monkeypatch.undo()
    assert sum(serialised) <= whole  # per dropped turn, the whole remaining chain: ~300 times this
    assert kept.size() <= 64 * 1024 < Conversation(chain[-len(kept.context) - 2 :], kept.items).size()
    assert kept.context == chain[-len(kept.context) :] and kept.context[0]["role"] == "user"
