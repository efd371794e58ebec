"""The official OpenAI SDK against our API: text equals the engine's, streaming, usage, disconnects."""

import json
import time
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI
from openai.types import Completion
from openai.types.chat import ChatCompletionMessageParam

from app.schemas.openai import ChatMessage
from deployments.engine.config import EngineConfig
from deployments.engine.interface import EngineRequest
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.sampling_params import SamplingParams
from tests.app.conftest import MODEL, Served
from tests.app.helpers import wait_for
from tests.app.test_metering import usage_rows
from tests.engine.helpers import drain, text

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]


@pytest.fixture(scope="module")
def client(served: Served, tenant: tuple[str, str]) -> OpenAI:
    return OpenAI(base_url=f"{served.url}/v1", api_key=tenant[1], max_retries=0)


@pytest.fixture(scope="module")
def reference(served: Served) -> Iterator[LLMEngine]:
    """A separate engine over the same model: what the platform must reproduce."""
    setup = served.setup
    engine = LLMEngine(
        EngineConfig(
            model=setup.model_dir, dtype="float32", adapter_store=setup.store_root, num_kv_blocks=128
        )
    )
    yield engine
    engine.close()


def engine_text(reference: LLMEngine, prompt_ids: list[int], params: SamplingParams) -> str:
    reference.add_request(EngineRequest(f"ref-{time.monotonic_ns()}", prompt_ids, params))
    return text(next(iter(drain(reference).values())))


def cached_tokens(completion: Completion) -> int:
    """usage.prompt_tokens_details.cached_tokens, which must be reported."""
    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
    cached = completion.usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return cached


def test_chat_text_equals_engine_output_for_the_same_seed(served: Served, client: OpenAI, reference) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0.8, top_p=0.95, seed=7
    )
    entry = served.services.catalog.get(MODEL)
    assert entry is not None
    prompt_ids = entry.prompts.chat([ChatMessage(**m) for m in MESSAGES])
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7)
    assert reply.choices[0].message.content == engine_text(reference, prompt_ids, params)
    assert reply.model == MODEL
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_streamed_chat_equals_the_non_streamed_one_and_ends_with_usage(client: OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    assert all(c.usage is None for c in chunks[:-1])
    last_usage = chunks[-1].usage
    assert whole.usage is not None
    assert chunks[-1].choices == [] and last_usage is not None
    assert last_usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_completions_stream_and_not(served: Served, client: OpenAI, reference) -> None:
    whole = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=12, temperature=0)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt="The sea is", max_tokens=12, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == whole.choices[0].text
    entry = served.services.catalog.get(MODEL)
    assert entry is not None
    ids = entry.prompts.completion("The sea is")
    assert whole.choices[0].text == engine_text(reference, ids, SamplingParams(max_tokens=12, temperature=0))
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == whole.choices[0].text


def test_stop_sequence_cuts_the_text_before_it(client: OpenAI) -> None:
    free = client.completions.create(model=MODEL, prompt="abc", max_tokens=30, temperature=0).choices[0].text
    stop = free[10:13]
    cut = client.completions.create(model=MODEL, prompt="abc", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == free[: free.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_cached_tokens_are_reported_and_never_shared_across_tenants(served: Served, client: OpenAI) -> None:
    long_prompt = " ".join(f"word{i}" for i in range(60))
    first = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2, temperature=0)
    assert cached_tokens(first) == 0
    assert cached_tokens(again) > 0
    assert again.usage is not None
    assert cached_tokens(again) < again.usage.prompt_tokens
    _, other_key = served.new_tenant("other-tenant-cache")
    other = OpenAI(base_url=f"{served.url}/v1", api_key=other_key, max_retries=0)
    theirs = other.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2, temperature=0)
    assert cached_tokens(theirs) == 0  # no cross-tenant prefix reuse


def test_client_disconnect_mid_stream_aborts_the_generation(served: Served) -> None:
    """The engine aborts the request (it does not finish it unseen), frees it within a bound, and the
    usage row bills what was generated before the client left."""
    tenant_id, key = served.new_tenant(f"gone-{time.monotonic_ns()}", tier="enterprise")
    max_tokens = 1000
    body = {"model": MODEL, "prompt": "go", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    before = served.engine.stats()
    with httpx.stream(
        "POST",
        f"{served.url}/v1/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        assert response.headers["x-request-id"]
        events = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunk = json.loads(line[6:])
                request_id = chunk["id"]
                assert chunk["choices"][0]["finish_reason"] is None  # still generating
                events += 1
            if events == 3:
                break  # leave: the connection closes with the generation still going
    left = time.monotonic()
    while (stats := served.engine.stats()).running or stats.waiting or stats.kv_usage:
        assert time.monotonic() - left < 5.0, f"the engine still holds the request: {stats}"
        time.sleep(0.01)
    assert stats.aborts == before.aborts + 1  # aborted, not finished first
    generated = stats.generated_tokens - before.generated_tokens
    assert 3 <= generated < max_tokens // 4
    wait_for(lambda: len(usage_rows(served, tenant_id)) == 1)
    (row,) = usage_rows(served, tenant_id)
    assert row.request_id == request_id and row.status == "aborted"
    assert 3 <= row.completion_tokens <= generated


def test_models_lists_the_base_model(client: OpenAI) -> None:
    models = client.models.list()
    assert MODEL in [m.id for m in models.data]
