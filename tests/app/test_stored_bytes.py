"""Stored responses cannot fill the disk (issue 35, item 1): what no prompt renders is not stored, expired
rows are swept on a timer for every tenant, not only when that tenant stores again, and a tenant's requests
in flight hold what they may store against its quota."""

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from app.responses.conversation import item_text
from app.responses.store import ResponseStore
from app.settings import ResponsesConfig
from billing.models import StoredResponse, utcnow
from billing.repository import held_bytes
from tests.app.conftest import MODEL, Served, serving
from tests.app.test_error_contract import assert_error
from tests.model_fixtures import TinySetup


@pytest.fixture(scope="module")
def tenant(served: Served) -> tuple[str, str]:
    return served.new_tenant(f"stored-bytes-{uuid.uuid4().hex[:8]}", tier="enterprise")


def post(served: Served, key: str, body: dict[str, Any]) -> httpx.Response:
    content = json.dumps(body, separators=(",", ":")).encode()
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    return httpx.post(f"{served.url}/v1/responses", headers=headers, content=content, timeout=120)


def stored_size(served: Served, response_id: str) -> tuple[int, int]:
    """(size_bytes as written, the JSON columns' length as read back)."""
    with served.services.session_factory() as s:
        row = s.scalar(select(StoredResponse).where(StoredResponse.id == response_id))
        assert row is not None
        columns = sum(
            len(json.dumps(v, separators=(",", ":"))) for v in (row.body, row.context, row.input_items)
        )
        return row.size_bytes, columns


def test_annotations_and_logprobs_sent_back_are_not_stored(served: Served, tenant: tuple[str, str]) -> None:
    """A tiny prompt carrying 256 KB of annotations and logprobs (never rendered) stored them all; now the row
    stays small, the response is served and can be read and continued."""
    _, key = tenant
    bulk = [{"type": "url_citation", "url": "x" * 1000, "title": "y" * 24}] * 256
    body = {
        "model": MODEL,
        "input": [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "hi", "annotations": bulk, "logprobs": bulk}],
            },
            {"type": "message", "role": "user", "content": "hey"},
        ],
        "max_output_tokens": 4,
        "store": True,
    }
    created = post(served, key, body)
    assert created.status_code == 200, created.text
    response = created.json()
    assert response["store"] is True
    size_bytes, columns = stored_size(served, response["id"])
    assert size_bytes < 8 * 1024 and columns < 8 * 1024, (size_bytes, columns)
    headers = {"authorization": f"Bearer {key}"}
    items = httpx.get(f"{served.url}/v1/responses/{response['id']}/input_items", headers=headers).json()
    part = items["data"][-1]["content"][0]
    assert part["text"] == "hi" and part["annotations"] == [] and part["logprobs"] == []
    continued = post(
        served,
        key,
        {"model": MODEL, "input": "more", "previous_response_id": response["id"], "max_output_tokens": 4},
    )
    assert continued.status_code == 200, continued.text


def test_a_client_item_id_is_bounded(served: Served, tenant: tuple[str, str]) -> None:
    """Ids are stored and listed, never rendered: 64 characters (OpenAI's own have 52) or a 400."""
    _, key = tenant
    item = {"type": "message", "role": "user", "content": "hey", "id": "msg_" + "x" * 252}
    assert_error(post(served, key, {"model": MODEL, "input": [item], "max_output_tokens": 1}), 400)
    item["id"] = "msg_" + "x" * 60
    assert post(served, key, {"model": MODEL, "input": [item], "max_output_tokens": 1}).status_code == 200


def test_an_idle_tenants_expired_rows_are_swept_on_a_timer(
    llama: TinySetup, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The ingress's lifespan sweeps every tenant's expired rows on a timer: a tenant that stored once and
    went quiet loses its expired rows without storing again; another tenant's live row stays."""
    responses = ResponsesConfig(sweep_interval_s=0.1)
    with serving(llama, tmp_path_factory.mktemp("sweep"), responses=responses) as app:
        idle, _ = app.new_tenant("idle")
        busy, _ = app.new_tenant("busy")
        sessions = app.services.session_factory
        ResponseStore(sessions, ResponsesConfig(retention_days=1e-9)).save(idle, row("resp_idle"), [], [])
        ResponseStore(sessions, responses).save(busy, row("resp_busy"), [], [])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "resp_idle" in ids(app):
            time.sleep(0.05)
        assert ids(app) == {"resp_busy"}


def row(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "model": MODEL, "previous_response_id": None, "output": []}


def ids(app: Served) -> set[str]:
    with app.services.session_factory() as s:
        return set(s.scalars(select(StoredResponse.id)))


def test_a_tenant_past_its_tiers_stored_bytes_quota_is_refused_storing(served: Served) -> None:
    """A tier's max_stored_response_bytes bounds each tenant's live stored responses (their size_bytes):
    past it, storing is a 403 naming the quota; store false is served; deleting a response frees room, and
    the tier set back to no bound stores again."""
    name = f"quota-{uuid.uuid4().hex[:8]}"
    with served.admin() as admin:
        tier = admin.post("/admin/tiers", json={"name": name, "max_stored_response_bytes": 4000})
        assert tier.status_code == 201 and tier.json()["max_stored_response_bytes"] == 4000, tier.text
    tenant_id, key = served.new_tenant(name, tier=name)
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
    stored: list[str] = []
    refused = None
    for _ in range(12):
        r = post(served, key, body)
        if r.status_code != 200:
            refused = r
            break
        stored.append(r.json()["id"])
    assert refused is not None and stored, "the quota never refused"
    error = assert_error(refused, 403, code="storage_quota_exceeded", param="store")
    assert "max_stored_response_bytes" in error["message"] and "4,000" in error["message"]
    store = ResponseStore(served.services.session_factory, served.services.settings.responses)
    # Checked before the output exists: the last response stored may pass the quota by its own row at most.
    assert store.stored_bytes(tenant_id) - 4000 < stored_size(served, stored[-1])[0]
    assert post(served, key, {**body, "store": False}).status_code == 200
    headers = {"authorization": f"Bearer {key}"}
    assert httpx.delete(f"{served.url}/v1/responses/{stored[0]}", headers=headers).status_code == 200
    assert post(served, key, body).status_code == 200
    assert post(served, key, body).status_code == 403
    with served.admin() as admin:
        cleared = admin.patch(f"/admin/tiers/{name}", json={"max_stored_response_bytes": None})
        assert cleared.json()["max_stored_response_bytes"] is None
    time.sleep(0.3)  # the fixture's auth cache lives 0.2 s
    assert post(served, key, body).status_code == 200


def test_a_continuation_chain_stores_bytes_linear_in_its_turns(
    served: Served, tenant: tuple[str, str]
) -> None:
    """Each continuation stored its whole chain again, so 20 turns stored ~20x20/2 turns' bytes; now each
    row holds its own items and refers to its predecessor: every row about the same size. Continuing,
    input_items and deleting behave as before, a deleted middle response included."""
    tenant_id, key = tenant
    headers = {"authorization": f"Bearer {key}"}
    ids: list[str] = []
    for n in range(20):
        previous = {"previous_response_id": ids[-1]} if ids else {}
        turn = {"model": MODEL, "input": f"turn {n} " + "x" * 20, "max_output_tokens": 2, **previous}
        created = post(served, key, turn)
        assert created.status_code == 200, created.text
        ids.append(created.json()["id"])
    sizes = [stored_size(served, i)[0] for i in ids]
    assert max(sizes) < 2 * min(sizes), sizes  # flattened, the 20th row held all 20 turns
    assert sum(sizes) < 20 * 2 * sizes[0]
    items = httpx.get(f"{served.url}/v1/responses/{ids[-1]}/input_items", headers=headers).json()
    assert [item_text(i) for i in items["data"]] == ["turn 19 " + "x" * 20]
    assert httpx.delete(f"{served.url}/v1/responses/{ids[10]}", headers=headers).status_code == 200
    assert httpx.get(f"{served.url}/v1/responses/{ids[10]}", headers=headers).status_code == 404
    store = ResponseStore(served.services.session_factory, ResponsesConfig())
    chain = store.get(tenant_id, ids[-1], chain=True)
    assert chain is not None
    said = [item_text(i).split(" x")[0] for i in chain.chain() if i.get("role") == "user"]
    assert said == [f"turn {n}" for n in range(20)]
    continued = post(served, key, {"model": MODEL, "input": "more", "previous_response_id": ids[-1]})
    assert continued.status_code == 200, continued.text
    ids.append(continued.json()["id"])
    for response_id in ids:  # oldest first: each is kept as a link until the last goes, then all go
        httpx.delete(f"{served.url}/v1/responses/{response_id}", headers=headers)
    with served.services.session_factory() as s:
        assert not set(s.scalars(select(StoredResponse.id).where(StoredResponse.id.in_(ids))))


def quota_tenant(served: Served, quota: int, rpm: int | None = None) -> tuple[str, str]:
    """A tenant of a new tier with this storage quota (and no other bound unless `rpm`)."""
    name = f"holds-{uuid.uuid4().hex[:8]}"
    limits = {"max_stored_response_bytes": quota, "rpm": rpm}
    with served.admin() as admin:
        tier = admin.post("/admin/tiers", json={"name": name, **limits})
        assert tier.status_code == 201, tier.text
    return served.new_tenant(name, tier=name)


def held(served: Served, tenant_id: str) -> int:
    with served.services.session_factory() as s:
        return held_bytes(s, tenant_id=tenant_id, now=utcnow())


def test_concurrent_requests_cannot_pass_the_storage_quota_together(served: Served) -> None:
    """Each request with store true holds what it may store while it runs, counted with the tenant's stored
    bytes under its lock: eight concurrent requests, any one of which fits, store no more than the quota
    together (before, each checked only what was stored before it: all eight were stored, past the quota).
    The refused ones are 403 storage_quota_exceeded, and no hold outlives its request."""
    tenant_id, key = quota_tenant(served, 6000)
    body = {"model": MODEL, "input": "hello there", "max_output_tokens": 4}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: post(served, key, body), range(8)))
    codes = sorted(r.status_code for r in answers)
    assert 200 in codes and 403 in codes and set(codes) == {200, 403}, [r.text[:200] for r in answers]
    for refused in (r for r in answers if r.status_code == 403):
        assert_error(refused, 403, code="storage_quota_exceeded", param="store")
        assert "held by your requests in flight" in refused.json()["error"]["message"]
    store = ResponseStore(served.services.session_factory, served.services.settings.responses)
    assert 0 < store.stored_bytes(tenant_id) <= 6000
    assert held(served, tenant_id) == 0
    stored = {r.json()["id"] for r in answers if r.status_code == 200}
    with served.services.session_factory() as s:
        rows = set(s.scalars(select(StoredResponse.id).where(StoredResponse.tenant_id == tenant_id)))
    assert rows == stored


def test_a_stream_left_early_gives_its_hold_back(served: Served) -> None:
    """A stream holds what it may store while it runs (its output counted at up to max_output_tokens); one
    the client leaves mid-way stores nothing and gives its hold back when it closes."""
    tenant_id, key = quota_tenant(served, 1_000_000)
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    body = {"model": MODEL, "input": "tell me a long story", "max_output_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/responses", headers=headers, json=body, timeout=60) as r:
        assert r.status_code == 200
        assert next(r.iter_lines()).startswith("event: response.created")
        assert held(served, tenant_id) > 400 * 16
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and held(served, tenant_id):
        time.sleep(0.05)
    assert held(served, tenant_id) == 0
    assert ResponseStore(served.services.session_factory, ResponsesConfig()).stored_bytes(tenant_id) == 0


def test_a_request_refused_at_admission_gives_its_hold_back(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past its tier's RPM a request is refused at admission, after its hold was taken: the hold goes at
    once, and only the first request's row is stored."""
    tenant_id, key = quota_tenant(served, 1_000_000, rpm=1)
    taken: list[str] = []
    hold = ResponseStore.hold

    def recorded(store: ResponseStore, tenant: str, response_id: str, size: int, quota: int) -> int | None:
        taken.append(response_id)
        return hold(store, tenant, response_id, size, quota)

    monkeypatch.setattr(ResponseStore, "hold", recorded)
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4}
    first = post(served, key, body)
    assert first.status_code == 200, first.text
    refused = post(served, key, body)
    assert_error(refused, 429)
    assert len(taken) == 2  # the refused request held too, before its admission
    assert held(served, tenant_id) == 0
    with served.services.session_factory() as s:
        rows = set(s.scalars(select(StoredResponse.id).where(StoredResponse.tenant_id == tenant_id)))
    assert rows == {first.json()["id"]}
