"""Stored responses on both database backends: read by (tenant, id) only, gone once expired, deleted, or
with their disabled tenant; and the bound on a stored conversation (truncation 'auto' or a 400)."""

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.errors import InvalidParameter
from app.responses.conversation import Conversation, with_ids
from app.responses.request import ResponseRequest
from app.responses.routes import _within_storage
from app.responses.store import ResponseStore
from app.settings import ResponsesConfig, Settings
from billing import repository
from billing.db import session_scope
from billing.models import StoredResponse, utcnow


def body(response_id: str) -> dict[str, Any]:
    output = [{"id": "msg_1", "type": "message", "role": "assistant", "status": "completed", "content": []}]
    return {"id": response_id, "model": "m", "previous_response_id": None, "output": output}


def tenants(sessions: sessionmaker[Session]) -> tuple[str, str]:
    with session_scope(sessions) as s:
        return repository.create_tenant(s, name="a").id, repository.create_tenant(s, name="b").id


def test_a_response_is_read_by_its_tenant_only_until_it_expires_or_is_deleted(
    session_factory: sessionmaker[Session],
) -> None:
    a, b = tenants(session_factory)
    store = ResponseStore(session_factory, ResponsesConfig(retention_days=1))
    items = [{"id": "msg_0", "type": "message", "role": "user", "content": "hi"}]
    store.save(a, body("resp_1"), [], items)
    stored = store.get(a, "resp_1")
    assert stored is not None and stored.input_items == items
    assert stored.chain() == [*items, *body("resp_1")["output"]]
    assert store.get(b, "resp_1") is None and not store.delete(b, "resp_1")
    assert store.get(a, "resp_1", now=utcnow() + timedelta(days=2)) is None
    assert store.delete(a, "resp_1") and store.get(a, "resp_1") is None and not store.delete(a, "resp_1")


def test_expired_rows_go_when_the_tenant_stores_again_and_all_go_with_the_tenant(
    session_factory: sessionmaker[Session],
) -> None:
    a, b = tenants(session_factory)
    ResponseStore(session_factory, ResponsesConfig(retention_days=1e-9)).save(a, body("resp_old"), [], [])
    store = ResponseStore(session_factory, ResponsesConfig())
    store.save(a, body("resp_new"), [], [])
    store.save(b, body("resp_b"), [], [])
    with session_factory() as s:
        assert set(s.scalars(select(StoredResponse.id))) == {"resp_new", "resp_b"}
    with session_scope(session_factory) as s:
        repository.disable_tenant(s, tenant_id=a)
    with session_factory() as s:
        assert s.scalar(select(func.count()).select_from(StoredResponse)) == 1
    assert store.get(b, "resp_b") is not None


def chain(turns: int) -> list[dict[str, Any]]:
    return [
        {"type": "message", "role": role, "content": "x" * 300, "id": f"msg_{n}_{role}"}
        for n in range(turns)
        for role in ("user", "assistant")
    ]


def test_a_stored_conversation_past_its_bound_drops_old_turns_or_is_refused() -> None:
    settings = Settings(responses=ResponsesConfig(max_stored_kb=2))
    conversation = Conversation(chain(10), with_ids(ResponseRequest(model="m", input="now").items()))
    auto = ResponseRequest(model="m", input="now", truncation="auto")
    kept = _within_storage(settings, auto, conversation)
    assert 0 < len(kept.context) < 20 and kept.context == conversation.context[-len(kept.context) :]
    assert kept.size() <= 2048 and kept.context[0]["role"] == "user"
    with pytest.raises(InvalidParameter) as refused:
        _within_storage(settings, ResponseRequest(model="m", input="now"), conversation)
    assert refused.value.code == "conversation_too_large" and refused.value.param == "previous_response_id"
    assert (
        _within_storage(settings, ResponseRequest(model="m", input="now", store=False), conversation)
        is conversation
    )
