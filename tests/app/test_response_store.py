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


def test_expired_rows_of_an_idle_tenant_go_with_a_sweep_and_all_go_with_the_tenant(
    session_factory: sessionmaker[Session],
) -> None:
    """Tenant a stores once and never again: its expired row is deleted by the sweep alone (before issue 35
    it stayed until a stored again); b's live row stays."""
    a, b = tenants(session_factory)
    ResponseStore(session_factory, ResponsesConfig(retention_days=1e-9)).save(a, body("resp_old"), [], [])
    store = ResponseStore(session_factory, ResponsesConfig())
    store.save(a, body("resp_new"), [], [])
    store.save(b, body("resp_b"), [], [])
    assert store.sweep() == 1
    with session_factory() as s:
        assert set(s.scalars(select(StoredResponse.id))) == {"resp_new", "resp_b"}
    with session_scope(session_factory) as s:
        repository.disable_tenant(s, tenant_id=a)
    with session_factory() as s:
        assert s.scalar(select(func.count()).select_from(StoredResponse)) == 1
    assert store.get(b, "resp_b") is not None


def test_the_sweep_deletes_in_bounded_batches(session_factory: sessionmaker[Session]) -> None:
    a, _ = tenants(session_factory)
    expired = ResponseStore(session_factory, ResponsesConfig(retention_days=1e-9))
    for n in range(5):
        expired.save(a, body(f"resp_{n}"), [], [])
    assert expired.sweep(batch=2, max_batches=1) == 2  # one call does at most batch * max_batches
    assert expired.sweep(batch=2) == 3
    with session_factory() as s:
        assert s.scalar(select(func.count()).select_from(StoredResponse)) == 0


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


def turn(n: int) -> list[dict[str, Any]]:
    return [{"id": f"msg_u{n}", "type": "message", "role": "user", "content": f"turn {n}"}]


def rows(sessions: sessionmaker[Session]) -> dict[str, StoredResponse]:
    with sessions() as s:
        return {row.id: row for row in s.scalars(select(StoredResponse))}


def continue_from(store: ResponseStore, tenant: str, previous_id: str, n: int, cut: int = 0) -> None:
    """Stores response resp_{n}, continuing previous_id's chain less its first `cut` items."""
    previous = store.get(tenant, previous_id, chain=True)
    assert previous is not None
    store.save(tenant, body(f"resp_{n}"), previous.chain()[cut:], turn(n), previous)


def test_a_continuation_is_stored_by_reference_and_read_through_its_chain(
    session_factory: sessionmaker[Session],
) -> None:
    """Issue 35: each continuation stored its whole chain again (quadratic). Now a row keeps its own items
    and refers to its predecessor; a truncated continuation records how much of the chain it dropped."""
    a, b = tenants(session_factory)
    store = ResponseStore(session_factory, ResponsesConfig())
    store.save(a, body("resp_0"), [], turn(0))
    for n in range(1, 20):
        continue_from(store, a, f"resp_{n - 1}", n)
    stored = rows(session_factory)
    for n in range(1, 20):
        row = stored[f"resp_{n}"]
        assert row.context == [] and row.context_from == f"resp_{n - 1}" and row.context_skip == 0
    sizes = [stored[f"resp_{n}"].size_bytes for n in range(20)]
    assert max(sizes) - min(sizes) < 16, sizes  # each row its own items: no row grows with the chain
    last = store.get(a, "resp_19", chain=True)
    assert last is not None
    output = body("resp_0")["output"]
    assert last.chain() == [item for n in range(20) for item in (*turn(n), *output)]
    assert store.get(b, "resp_19", chain=True) is None
    # Truncated: the chain less its first two turns (four items).
    continue_from(store, a, "resp_19", 20, cut=4)
    cut = store.get(a, "resp_20", chain=True)
    assert cut is not None and rows(session_factory)["resp_20"].context_skip == 4
    assert cut.chain() == [item for n in range(2, 21) for item in (*turn(n), *output)]


def test_a_continued_response_deleted_stays_a_link_until_nothing_continues_it(
    session_factory: sessionmaker[Session],
) -> None:
    """Deleting a response that a stored continuation refers to hides it (404 on every read) but keeps its
    items for the chain, as the flattened copy used to; deleting the continuation removes both."""
    a, _ = tenants(session_factory)
    store = ResponseStore(session_factory, ResponsesConfig())
    store.save(a, body("resp_0"), [], turn(0))
    continue_from(store, a, "resp_0", 1)
    continue_from(store, a, "resp_1", 2)
    assert store.delete(a, "resp_1") and not store.delete(a, "resp_1")
    assert store.get(a, "resp_1") is None and store.get(a, "resp_1", chain=True) is None
    output = body("resp_0")["output"]
    last = store.get(a, "resp_2", chain=True)
    assert last is not None and last.chain() == [item for n in range(3) for item in (*turn(n), *output)]
    assert set(rows(session_factory)) == {"resp_0", "resp_1", "resp_2"}
    assert store.delete(a, "resp_2")
    assert set(rows(session_factory)) == {"resp_0"}


def test_a_continuation_of_a_response_gone_meanwhile_keeps_its_context_itself(
    session_factory: sessionmaker[Session],
) -> None:
    """The predecessor was read, then deleted (nothing continued it yet) before the continuation was stored:
    the continuation stores its context flattened and still reads whole."""
    a, _ = tenants(session_factory)
    store = ResponseStore(session_factory, ResponsesConfig())
    store.save(a, body("resp_0"), [], turn(0))
    previous = store.get(a, "resp_0", chain=True)
    assert previous is not None and store.delete(a, "resp_0")
    store.save(a, body("resp_1"), previous.chain(), turn(1), previous)
    row = rows(session_factory)["resp_1"]
    assert row.context_from is None and row.context == previous.chain()
    stored = store.get(a, "resp_1", chain=True)
    assert stored is not None and stored.chain() == [*previous.chain(), *turn(1), *body("resp_1")["output"]]


def test_a_chain_lives_as_long_as_its_newest_response_and_its_walk_is_bounded(
    session_factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link's expiry moves up to its newest continuation's, so a later continuation still reads its whole
    chain; past MAX_DEPTH hops a continuation stores its context itself and the walk starts there."""
    a, _ = tenants(session_factory)
    ResponseStore(session_factory, ResponsesConfig(retention_days=1)).save(a, body("resp_0"), [], turn(0))
    store = ResponseStore(session_factory, ResponsesConfig(retention_days=30))
    monkeypatch.setattr("app.responses.store.MAX_DEPTH", 3)
    for n in range(1, 8):
        continue_from(store, a, f"resp_{n - 1}", n)
    stored = rows(session_factory)
    assert [stored[f"resp_{n}"].depth for n in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert stored["resp_4"].context_from is None and len(stored["resp_4"].context) == 8
    last = store.get(a, "resp_3", now=utcnow() + timedelta(days=2), chain=True)
    output = body("resp_0")["output"]
    assert last is not None and last.chain() == [item for n in range(4) for item in (*turn(n), *output)]
    last = store.get(a, "resp_7", chain=True)
    assert last is not None and last.chain() == [item for n in range(8) for item in (*turn(n), *output)]
