"""Adapters end to end on Ray Serve: upload a PEFT adapter over HTTP, use it at once through the OpenAI SDK
with PEFT's output, replace it while a long request keeps its version, delete it everywhere."""

import json
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from openai import NotFoundError, OpenAI
from openai.types.chat import ChatCompletionMessageParam

from app.schemas.openai import ChatMessage
from app.served_models.prompts import PromptBuilder
from bench.admin_upload import post_adapter
from tests.e2e.conftest import ServeApp, engine_settings
from tests.engine.reference import PeftReference

PROMPT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "tell me a story"}]
LONG = 400  # tokens: seconds of streaming, so an upload lands while it runs
# Greedy on demo-sql runs the whole LONG without meeting EOS for this prompt ("tell me a story" stops at 10).
LONG_PROMPT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "tell me a long story"}]


def upload(app: ServeApp, name: str, owner: str, source: Path, base_model: str) -> httpx.Response:
    with app.admin() as admin:
        return post_adapter(admin, name, owner, source, base_model)


def chat(client: OpenAI, model: str, max_tokens: int = 10) -> str:
    reply = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content or ""


def expected(
    app: ServeApp,
    arch: str,
    adapter: str,
    max_tokens: int = 10,
    prompt: list[ChatCompletionMessageParam] = PROMPT,
) -> str:
    setup = app.setups[arch]
    prompts = PromptBuilder(setup.model_dir)
    ids = PeftReference(setup.model_dir, {adapter: setup.adapter_dirs[adapter]}).greedy(
        prompts.chat([ChatMessage(**m) for m in prompt]), adapter, max_tokens
    )
    decoded = prompts.tokenizer.decode(ids, skip_special_tokens=True)
    assert isinstance(decoded, str)  # one sequence of ids decodes to one string
    return decoded


def eventually(check, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.2)


@pytest.mark.slow
def test_upload_use_replace_delete(serve_app: ServeApp) -> None:
    tenant_id, key = serve_app.new_tenant(f"adp-{uuid.uuid4().hex[:8]}")
    client = OpenAI(base_url=f"{serve_app.url}/v1", api_key=key, max_retries=0, timeout=60)

    first = upload(
        serve_app, "story", tenant_id, serve_app.setups["llama"].adapter_dirs["demo-sql"], "tiny-llama"
    )
    assert first.status_code == 201, first.text
    assert chat(client, "story") == expected(serve_app, "llama", "demo-sql")

    # A long request on version 1, and version 2 uploaded while it runs.
    long_text: list[str] = []
    started, finished = threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def long_request() -> None:
        body = {
            "model": "story",
            "messages": LONG_PROMPT,
            "max_tokens": LONG,
            "temperature": 0,
            "stream": True,
        }
        try:
            with httpx.stream("POST", f"{serve_app.url}/v1/chat/completions", json=body, timeout=120,
                              headers={"authorization": f"Bearer {key}"}) as response:  # fmt: skip
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        started.set()
                        choices = json.loads(line[6:])["choices"]
                        long_text.append(choices[0]["delta"].get("content") or "" if choices else "")
                        if choices and choices[0]["finish_reason"] is not None:
                            finished.set()
        except BaseException as error:  # the thread's failure fails the test below
            failures.append(error)
            raise

    worker = threading.Thread(target=long_request)
    worker.start()
    assert started.wait(60)
    second = upload(serve_app, "story", tenant_id, serve_app.setups["llama"].adapter_dirs["demo-pirate"],
                    "tiny-llama")  # fmt: skip
    assert second.status_code == 201 and second.json()["version"] == 2
    assert not finished.is_set(), "the stream ended before version 2 landed: nothing was tested"
    want_v2 = expected(serve_app, "llama", "demo-pirate")
    eventually(lambda: chat(client, "story") == want_v2)
    worker.join(120)
    assert not worker.is_alive() and not failures, failures
    assert finished.is_set()
    assert "".join(long_text) == expected(serve_app, "llama", "demo-sql", LONG, LONG_PROMPT)

    # Deleted: 404 to the tenant at once, and dropped from the engine replica.
    with serve_app.admin() as admin:
        assert admin.delete(f"/admin/adapters/{first.json()['id']}").status_code == 200
    with pytest.raises(NotFoundError):
        chat(client, "story")
    handle = serve_app.engine_handle("tiny-llama")

    def dropped() -> bool:
        stats = handle.stats.remote().result()
        return not any(r.startswith(first.json()["id"]) for r in stats.cpu_adapters + stats.device_adapters)

    eventually(dropped)


@pytest.mark.slow
def test_public_adapter_on_the_second_base_model(serve_app: ServeApp) -> None:
    name = f"pub-{uuid.uuid4().hex[:6]}"
    made = upload(
        serve_app, name, "public", serve_app.setups["qwen2"].adapter_dirs["demo-poet"], "tiny-qwen2"
    )
    assert made.status_code == 201, made.text
    _, key = serve_app.new_tenant(f"q-{uuid.uuid4().hex[:8]}")
    client = OpenAI(base_url=f"{serve_app.url}/v1", api_key=key, max_retries=0, timeout=60)
    cards = {m.id: m for m in client.models.list().data}
    assert f"public/{name}" in cards
    assert chat(client, f"public/{name}") == expected(serve_app, "qwen2", "demo-poet")


FAMILIES = {  # arch -> the modules its demo adapter targets (Phi-3's q/k/v and gate/up are fused linears)
    "phi3": ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"],
    "qwen3": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
    "gemma3_text": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
}


@pytest.mark.slow
def test_an_adapter_on_each_current_family_serves_peft(serve_app: ServeApp) -> None:
    """Phi-3, Qwen3 and Gemma 3 through `serve run` (one deploy, a model each, on our forward): an adapter
    uploaded over HTTP serves PEFT's greedy text."""
    setups = serve_app.setups
    models = [{"name": f"tiny-{arch}", "engine": engine_settings(setups[arch])} for arch in FAMILIES]
    serve_app.deploy({"models": models})
    try:
        tenant_id, key = serve_app.new_tenant(f"fam-{uuid.uuid4().hex[:8]}")
        client = OpenAI(base_url=f"{serve_app.url}/v1", api_key=key, max_retries=0, timeout=60)
        for arch, targets in FAMILIES.items():
            name = f"pirate-{arch.replace('_', '-')}"
            made = upload(serve_app, name, tenant_id, serve_app.setups[arch].adapter_dirs["demo-pirate"],
                          f"tiny-{arch}")  # fmt: skip
            assert made.status_code == 201, made.text
            assert made.json()["target_modules"] == targets
            assert chat(client, name) == expected(serve_app, arch, "demo-pirate"), arch
    finally:
        serve_app.deploy_default()
