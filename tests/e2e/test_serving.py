"""End to end on Ray Serve: OpenAI SDK and raw HTTP against two base models served side by side."""

import json
import time

import httpx
import pytest
from openai import NotFoundError, OpenAI
from openai.types.chat import ChatCompletionMessageParam

from app.prompts import PromptBuilder
from app.schemas.openai import ChatMessage
from deployments.engine.config import EngineConfig
from deployments.engine.interface import EngineRequest
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.sampling_params import SamplingParams
from tests.e2e.conftest import ServeApp
from tests.engine.helpers import drain, text

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def key(serve_app: ServeApp) -> str:
    return serve_app.new_tenant("e2e-acme")[1]


@pytest.fixture(scope="module")
def client(serve_app: ServeApp, key: str) -> OpenAI:
    return OpenAI(base_url=f"{serve_app.url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.mark.parametrize(("model", "arch"), [("tiny-llama", "llama"), ("tiny-qwen2", "qwen2")])
def test_chat_over_http_equals_the_engine(serve_app: ServeApp, client: OpenAI, model: str, arch: str) -> None:
    setup = serve_app.setups[arch]
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=16, temperature=0.7, seed=3
    )
    engine = LLMEngine(EngineConfig(model=setup.model_dir, adapter_store=setup.store_root, num_kv_blocks=64))
    prompt = PromptBuilder(setup.model_dir).chat([ChatMessage(**m) for m in MESSAGES])
    engine.add_request(EngineRequest("ref", prompt, SamplingParams(max_tokens=16, temperature=0.7, seed=3)))
    assert reply.choices[0].message.content == text(drain(engine)["ref"])
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)
    engine.close()


def test_both_base_models_are_listed(client: OpenAI) -> None:
    ids = {m.id for m in client.models.list().data}
    assert {"tiny-llama", "tiny-qwen2"} <= ids


def test_streaming_chat_and_completion_with_usage(client: OpenAI) -> None:
    whole = client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=12, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny-llama",
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )
    last_usage = chunks[-1].usage
    assert last_usage is not None and whole.usage is not None
    assert last_usage.total_tokens == whole.usage.total_tokens
    streamed = client.completions.create(
        model="tiny-qwen2", prompt="Once", max_tokens=8, temperature=0, stream=True
    )
    assert sum(1 for c in streamed if c.choices) >= 1


def test_unknown_model_is_a_404_in_openai_shape(client: OpenAI) -> None:
    with pytest.raises(NotFoundError) as error:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    body = error.value.body
    assert isinstance(body, dict)
    assert body["code"] == "model_not_found"


def test_raw_http_errors_carry_request_ids(serve_app: ServeApp, key: str) -> None:
    unauthorized = httpx.post(f"{serve_app.url}/v1/completions", json={"model": "tiny-llama", "prompt": "x"})
    assert unauthorized.status_code == 401
    assert unauthorized.json()["error"]["code"] == "invalid_api_key"
    assert unauthorized.headers["x-request-id"]
    headers = {"authorization": f"Bearer {key}", "x-request-id": "my-trace-1"}
    bad = httpx.post(
        f"{serve_app.url}/v1/completions",
        headers=headers,
        json={"model": "tiny-llama", "prompt": "x", "temperature": 9},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    assert bad.headers["x-request-id"] == "my-trace-1"
    too_long = httpx.post(
        f"{serve_app.url}/v1/completions",
        headers=headers,
        json={"model": "tiny-llama", "prompt": [1] * 1100, "max_tokens": 4},
    )
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"


def test_client_disconnect_aborts_on_the_engine_replica(serve_app: ServeApp, key: str) -> None:
    body = {"model": "tiny-llama", "prompt": "go", "max_tokens": 900, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST",
        f"{serve_app.url}/v1/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        seen = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                json.loads(line[6:])
                seen += 1
            if seen == 3:
                break
    handle = serve_app.engine_handle("tiny-llama")
    deadline = time.monotonic() + 20
    stats = handle.stats.remote().result()
    while (stats.running or stats.waiting) and time.monotonic() < deadline:
        time.sleep(0.1)
        stats = handle.stats.remote().result()
    assert stats.running == 0 and stats.waiting == 0
    assert stats.kv_usage == 0.0
