"""Adapters through HTTP: upload (archive or two files), use at once, versions, isolation, pin, delete, and
what a tenant hears when the engine cannot find an adapter's files."""

import io
import shutil
import tarfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from openai import NotFoundError, OpenAI
from openai.types.chat import ChatCompletionMessageParam
from sqlalchemy.orm import Session

from adapters.ref import AdapterRef
from app.schemas.openai import ChatMessage
from bench.admin_upload import post_adapter
from billing import adapter_registry
from tests.app.conftest import MODEL, Served
from tests.engine.reference import PeftReference

PROMPT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "write something"}]


def upload_files(served: Served, name: str, owner: str, source: Path) -> httpx.Response:
    with served.admin() as admin:
        return post_adapter(admin, name, owner, source)


def upload_archive(served: Served, name: str, owner: str, source: Path) -> httpx.Response:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            tar.add(source / file, arcname=f"my-adapter/{file}")
    with served.admin() as admin:
        return admin.post(
            "/admin/adapters",
            data={"name": name, "owner": owner, "base_model": MODEL},
            files={"file": ("adapter.tar.gz", buffer.getvalue(), "application/gzip")},
        )


@pytest.fixture(scope="module")
def reference(served: Served) -> PeftReference:
    return PeftReference(served.setup.model_dir, served.setup.adapter_dirs)


def greedy(client: OpenAI, model: str, max_tokens: int = 12) -> str:
    reply = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content or ""


def reference_text(
    served: Served, reference: PeftReference, adapter: str | None, max_tokens: int = 12
) -> str:
    entry = served.services.catalog.get(MODEL)
    assert entry is not None
    prompts = entry.prompts
    ids = reference.greedy(prompts.chat([ChatMessage(**m) for m in PROMPT]), adapter, max_tokens)
    decoded = prompts.tokenizer.decode(ids, skip_special_tokens=True)
    assert isinstance(decoded, str)  # one sequence of ids decodes to one string
    return decoded


def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_upload_then_use_at_once_equals_peft(served: Served, reference: PeftReference) -> None:
    tenant_id, key = served.new_tenant(f"up-{uuid.uuid4().hex[:8]}")
    response = upload_files(served, "sql", tenant_id, served.setup.adapter_dirs["demo-sql"])
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["version"] == 1 and body["status"] == "ready" and body["owner"] == tenant_id
    assert body["rank"] == 8 and body["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert len(body["sha256"]) == 64 and body["size_bytes"] > 0 and body["model"] == "sql"
    client = OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0)
    assert greedy(client, "sql") == reference_text(served, reference, "demo-sql")
    assert greedy(client, "sql") != greedy(client, MODEL)
    assert "sql" in [m.id for m in client.models.list().data]


def test_archive_upload_and_a_new_version_takes_over(served: Served, reference: PeftReference) -> None:
    tenant_id, key = served.new_tenant(f"ver-{uuid.uuid4().hex[:8]}")
    first = upload_archive(served, "helper", tenant_id, served.setup.adapter_dirs["demo-poet"])
    assert first.status_code == 201, first.text
    client = OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0)
    assert greedy(client, "helper") == reference_text(served, reference, "demo-poet")
    second = upload_files(served, "helper", tenant_id, served.setup.adapter_dirs["demo-pirate"])
    assert second.status_code == 201 and second.json()["id"] == first.json()["id"]
    assert second.json()["version"] == 2 and [v["version"] for v in second.json()["versions"]] == [1, 2]
    want = reference_text(served, reference, "demo-pirate")
    wait_until(lambda: greedy(client, "helper") == want)  # within the resolver's cache TTL


def test_a_running_request_finishes_on_the_version_it_started_with(
    served: Served, reference: PeftReference
) -> None:
    tenant_id, key = served.new_tenant(f"swap-{uuid.uuid4().hex[:8]}")
    assert upload_files(served, "swap", tenant_id, served.setup.adapter_dirs["demo-legal"]).status_code == 201
    body = {"model": "swap", "messages": PROMPT, "max_tokens": 60, "temperature": 0, "stream": True}
    pieces: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, timeout=60,
                          headers={"authorization": f"Bearer {key}"}) as response:  # fmt: skip
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                    delta = __import__("json").loads(line[6:])["choices"]
                    pieces.append(delta[0]["delta"].get("content") or "" if delta else "")

    worker = threading.Thread(target=stream)
    worker.start()
    assert started.wait(30)
    assert upload_files(served, "swap", tenant_id, served.setup.adapter_dirs["demo-chef"]).status_code == 201
    worker.join(60)
    assert "".join(pieces) == reference_text(served, reference, "demo-legal", 60)


def test_private_adapters_are_invisible_to_other_tenants(served: Served) -> None:
    owner_id, owner_key = served.new_tenant(f"own-{uuid.uuid4().hex[:8]}")
    _, other_key = served.new_tenant(f"oth-{uuid.uuid4().hex[:8]}")
    assert upload_files(served, "secret", owner_id, served.setup.adapter_dirs["demo-sql"]).status_code == 201
    other = OpenAI(base_url=f"{served.url}/v1", api_key=other_key, max_retries=0)
    with pytest.raises(NotFoundError) as theirs:
        greedy(other, "secret")
    with pytest.raises(NotFoundError) as nothing:
        greedy(other, "no-such-adapter-xyz")
    not_found = nothing.value.body
    assert isinstance(not_found, dict)
    assert theirs.value.body == {**not_found, "message": not_found["message"].replace(
        "no-such-adapter-xyz", "secret")}  # fmt: skip
    assert "secret" not in [m.id for m in other.models.list().data]
    owner = OpenAI(base_url=f"{served.url}/v1", api_key=owner_key, max_retries=0)
    assert "secret" in [m.id for m in owner.models.list().data]


def test_public_adapters_serve_every_tenant_under_public_prefix(served: Served) -> None:
    name = f"shared-{uuid.uuid4().hex[:6]}"
    response = upload_files(served, name, "public", served.setup.adapter_dirs["demo-chef"])
    assert response.status_code == 201 and response.json()["model"] == f"public/{name}"
    for _ in range(2):
        _, key = served.new_tenant(f"pub-{uuid.uuid4().hex[:8]}")
        client = OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0)
        assert f"public/{name}" in [m.id for m in client.models.list().data]
        assert greedy(client, f"public/{name}")
        with pytest.raises(NotFoundError):
            greedy(client, name)  # a plain name is always the tenant's own


def test_delete_makes_it_unservable_at_once_and_frees_it_on_the_engine(served: Served) -> None:
    tenant_id, key = served.new_tenant(f"del-{uuid.uuid4().hex[:8]}")
    created = upload_files(served, "gone", tenant_id, served.setup.adapter_dirs["demo-poet"]).json()
    client = OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0)
    greedy(client, "gone")
    ref = str(AdapterRef(created["id"], 1))
    assert ref in served.engine.stats().cpu_adapters
    with served.admin() as admin:
        deleted = admin.delete(f"/admin/adapters/{created['id']}")
        assert deleted.status_code == 200 and deleted.json()["status"] == "deleted"
        assert admin.get(f"/admin/adapters/{created['id']}").json()["deleted_at"]  # the row stays
    with pytest.raises(NotFoundError):
        greedy(client, "gone")
    wait_until(lambda: ref not in served.engine.stats().cpu_adapters + served.engine.stats().device_adapters)
    assert not (served.services.store.root / created["id"]).exists()
    again = upload_files(
        served, "gone", tenant_id, served.setup.adapter_dirs["demo-sql"]
    )  # name is free again
    assert again.status_code == 201 and again.json()["id"] != created["id"]


def register_without_files(sessions: Callable[[], Session], name: str, owner: str, base_model: str) -> str:
    """A version the registry lists and the store does not hold: what an adapter looks like once its stored
    files vanished. Registered directly, so that no engine could have read it before (an upload is
    prefetched by the registry watcher at once)."""
    with sessions() as session, session.begin():
        adapter = adapter_registry.create_adapter(session, name=name, owner=owner, base_model=base_model)
        adapter_registry.add_version(
            session, adapter=adapter, version=1, rank=8, target_modules=["q_proj"], sha256="0" * 64,
            size_bytes=1,
        )  # fmt: skip
        return adapter.id


def assert_tenant_error(response: httpx.Response, status: int, code: str) -> dict[str, str]:
    """An OpenAI-shaped error with `status` and `code` that names no internal id, path or exception."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    assert not any(leak in error["message"] for leak in ("ad_", "@v", "/", "Error")), error
    if status == 503:
        assert int(response.headers["retry-after"]) >= 1
    return dict(error)


def test_an_adapter_the_engine_cannot_find_is_a_503_while_registered_and_a_404_once_deleted(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ingress routes a request with the version its cache names; the engine has no files for it. The
    registry decides: still registered, the platform lost its files (503, retry); deleted since, the
    model is gone (404). Before, both were a 500 quoting the engine's `adapter 'ad_...@v1' does not
    exist`."""
    monkeypatch.setattr(served.services.adapters, "ttl", 60.0)  # the ingress keeps naming the version
    tenant_id, key = served.new_tenant(f"lost-{uuid.uuid4().hex[:8]}")
    headers = {"authorization": f"Bearer {key}"}
    register_without_files(served.services.session_factory, "vanished", tenant_id, MODEL)
    body = {"model": "vanished", "prompt": "hi", "max_tokens": 2}
    with httpx.Client(base_url=served.url, headers=headers, timeout=30) as http:
        for stream in (False, True):  # a stream too gets its status before any event
            answer = http.post("/v1/completions", json={**body, "stream": stream})
            assert_tenant_error(answer, 503, "model_unavailable")

        created = upload_files(served, "doomed", tenant_id, served.setup.adapter_dirs["demo-sql"]).json()
        client = OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0)
        greedy(client, "doomed")  # the ingress caches doomed -> its version
        # Another ingress replica deletes it (this one's cache is not told); the engine drops it.
        with served.services.session_factory() as session, session.begin():
            adapter_registry.delete_adapter(session, adapter_id=created["id"])
        shutil.rmtree(served.services.store.root / created["id"])
        ref = str(AdapterRef(created["id"], 1))
        wait_until(
            lambda: ref not in [*served.engine.stats().cpu_adapters, *served.engine.stats().device_adapters]
        )
        gone = http.post("/v1/completions", json={**body, "model": "doomed"})
        error = assert_tenant_error(gone, 404, "model_not_found")
        assert "doomed" in error["message"]  # the name the tenant used, and nothing else
    assert served.engine.running


def test_pin_keeps_it_in_a_device_slot(served: Served) -> None:
    tenant_id, _ = served.new_tenant(f"pin-{uuid.uuid4().hex[:8]}")
    created = upload_files(served, "hot", tenant_id, served.setup.adapter_dirs["demo-legal"]).json()
    with served.admin() as admin:
        patched = admin.patch(f"/admin/adapters/{created['id']}", json={"pinned": True})
        assert patched.status_code == 200 and patched.json()["pinned"] is True
        ref = str(AdapterRef(created["id"], 1))
        wait_until(lambda: ref in served.engine.stats().device_adapters)
        admin.patch(f"/admin/adapters/{created['id']}", json={"pinned": False})
    wait_until(lambda: AdapterRef(created["id"], 1) not in served.engine.adapters.slots.pinned)


def test_admin_listing_filters(served: Served) -> None:
    tenant_id, _ = served.new_tenant(f"list-{uuid.uuid4().hex[:8]}")
    upload_files(served, "one", tenant_id, served.setup.adapter_dirs["demo-sql"])
    with served.admin() as admin:
        mine = admin.get("/admin/adapters", params={"owner": tenant_id}).json()["data"]
        assert [a["name"] for a in mine] == ["one"]
        assert admin.get("/admin/adapters/ad_doesnotexist").status_code == 404
