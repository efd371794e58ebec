"""Tenants who send too much: bodies over the limit get 413 unread, prompts are bounded in messages and
characters, tokenisation runs off the event loop, and numbers no model can serve are refused by name
before they reach the limiter or the engine. Nothing refused here leaves a usage row."""

import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic import TypeAdapter, ValidationError

from app.completions.plan import INLINE_PROMPT_CHARS
from app.schemas.openai import MAX_PROMPT_TOKENS, MAX_PROMPTS, CompletionRequest, Prompt
from app.served_models.prompts import ChatPrompt, PromptBuilder
from tests.app.conftest import ADMIN_KEY, MODEL, Served
from tests.app.features import best_of
from tests.app.test_error_contract import assert_error
from tests.app.test_metering import usage_rows

CONTEXT = 1024


@pytest.fixture(scope="module")
def tenant(served: Served) -> tuple[str, str]:
    return served.new_tenant(f"bounds-{uuid.uuid4().hex[:8]}", tier="enterprise")


def post(served: Served, key: str, path: str, **kwargs: object) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    return httpx.post(f"{served.url}{path}", headers=headers, timeout=60, **kwargs)  # type: ignore[arg-type]


def test_a_body_over_the_limit_is_413_before_it_is_read(served: Served, tenant: tuple[str, str]) -> None:
    tenant_id, key = tenant
    limit = served.services.settings.max_body_kb * 1024
    big = b'{"model": "tiny-llama", "prompt": "' + b"a" * limit + b'"}'
    r = post(served, key, "/v1/completions", content=big)
    error = assert_error(r, 413, code="request_body_too_large")
    assert "larger" in error["message"]

    def chunks() -> Iterator[bytes]:  # no content-length: counted as it arrives
        for start in range(0, len(big), 65536):
            yield big[start : start + 65536]

    assert_error(post(served, key, "/v1/completions", content=chunks()), 413, code="request_body_too_large")
    assert usage_rows(served, tenant_id) == []


def test_adapter_uploads_have_their_own_larger_limit(served: Served) -> None:
    over_tenant_limit = b"x" * (served.services.settings.max_body_kb * 1024 + 1)
    r = httpx.post(
        f"{served.url}/admin/adapters",
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
        data={"name": "too-big-for-chat", "owner": "public"},
        files={"file": ("adapter.zip", over_tenant_limit)},
        timeout=60,
    )
    assert r.status_code == 400, r.text  # read and judged as an adapter (not a zip), not refused unread


def test_message_count_and_prompt_characters_are_capped(served: Served, tenant: tuple[str, str]) -> None:
    tenant_id, key = tenant
    settings = served.services.settings
    many = [{"role": "user", "content": "hi"}] * (settings.max_messages + 1)
    r = post(served, key, "/v1/chat/completions", json={"model": MODEL, "messages": many})
    assert_error(r, 400, code="too_many_messages", param="messages")
    long = "a" * (settings.max_prompt_chars + 1)
    r = post(served, key, "/v1/completions", json={"model": MODEL, "prompt": long})
    assert_error(r, 400, code="prompt_too_large", param="prompt")
    messages = [{"role": "user", "content": long[: len(long) // 2]}, {"role": "user", "content": long}]
    r = post(served, key, "/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert_error(r, 400, code="prompt_too_large", param="messages")
    assert usage_rows(served, tenant_id) == []


def compact(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()  # 2 bytes a token id: 1M fit the 2 MB limit


def test_token_id_prompts_count_against_the_prompt_characters(
    served: Served, tenant: tuple[str, str]
) -> None:
    """A token id counts as a character of text: ids never buy a longer prompt than text could."""
    tenant_id, key = tenant
    limit = served.services.settings.max_prompt_chars
    r = post(served, key, "/v1/completions", content=compact({"model": MODEL, "prompt": [7] * (limit + 1)}))
    error = assert_error(r, 400, code="prompt_too_large", param="prompt")
    assert f"{limit + 1:,} token ids" in error["message"], error
    half = [7] * (limit // 2 + 1)
    r = post(served, key, "/v1/completions", content=compact({"model": MODEL, "prompt": [half, half]}))
    assert_error(r, 400, code="prompt_too_large", param="prompt")
    assert usage_rows(served, tenant_id) == []


@pytest.mark.parametrize(
    "prompt", [["a"] * (MAX_PROMPTS + 1), [[7]] * (MAX_PROMPTS + 1)], ids=["texts", "ids"]
)
def test_prompt_lists_past_the_schemas_bound_are_400_naming_it(
    served: Served, tenant: tuple[str, str], prompt: list[Any]
) -> None:
    _, key = tenant
    r = post(served, key, "/v1/completions", json={"model": MODEL, "prompt": prompt})
    error = assert_error(r, 400, param="prompt")
    assert f"at most {MAX_PROMPTS:,}" in error["message"], error


def test_a_prompt_past_the_schemas_token_bound_is_refused_by_its_length() -> None:
    """Refused before any id is validated (a 2 MB body cannot reach the bound: a larger max_body_kb can)."""
    over = [7] * (MAX_PROMPT_TOKENS + 1)
    for prompt, which in ((over, "the prompt"), ([[7], over], "prompt 1")):
        with pytest.raises(ValidationError) as raised:
            CompletionRequest.model_validate({"model": MODEL, "prompt": prompt})
        [error] = raised.value.errors()
        assert error["loc"] == ("prompt",)
        assert (
            f"{which} has {MAX_PROMPT_TOKENS + 1:,} token ids; at most {MAX_PROMPT_TOKENS:,}" in error["msg"]
        )


def test_a_token_id_prompt_is_validated_once_as_token_ids() -> None:
    """Its first element picks the shape: a plain union validated a 2 MB list of ids as strings first (an
    error per id), ~1 s of the event loop every request shares."""
    with pytest.raises(ValidationError) as raised:
        TypeAdapter(Prompt).validate_python([7] * 1000 + ["x"])
    assert raised.value.error_count() == 1  # one shape tried (the union reported 2,003 errors)
    ids = [7] * 1_000_000
    request = best_of(3, lambda: CompletionRequest.model_validate({"model": MODEL, "prompt": ids}))
    ids_alone = best_of(3, lambda: TypeAdapter(list[int]).validate_python(ids))
    assert request < 5 * ids_alone, (request, ids_alone)  # generous: about 1x; the union was 20-50x


def test_templating_and_tokenisation_run_off_the_event_loop_once_a_prompt_is_large(
    served: Served, tenant: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short prompt is templated on the event loop (cheaper than the hop to a thread); one of
    INLINE_PROMPT_CHARS or more in the thread pool, where it holds no other request up."""
    threads: list[str] = []
    chat, completion = PromptBuilder.chat_prompt, PromptBuilder.completion

    def recording_chat(self: PromptBuilder, *args: object) -> ChatPrompt:
        threads.append(threading.current_thread().name)
        return chat(self, *args)  # type: ignore[arg-type]

    def recording_completion(self: PromptBuilder, *args: object) -> list[int]:
        threads.append(threading.current_thread().name)
        return completion(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(PromptBuilder, "chat_prompt", recording_chat)
    monkeypatch.setattr(PromptBuilder, "completion", recording_completion)
    _, key = tenant
    for text in ("hi", "hello world " * (INLINE_PROMPT_CHARS // 12 + 1)):
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
        assert post(served, key, "/v1/chat/completions", json=body).status_code == 200
        body = {"model": MODEL, "prompt": text, "max_tokens": 1}
        assert post(served, key, "/v1/completions", json=body).status_code == 200
    assert len(threads) == 4
    loop_thread = threads[0]  # the server's event loop
    assert threads[1] == loop_thread and not loop_thread.startswith("AnyIO worker thread"), threads
    assert all(name.startswith("AnyIO worker thread") for name in threads[2:]), threads


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"prompt": [5] * CONTEXT, "max_tokens": 1}, "prompt", "context_length_exceeded"),
        ({"prompt": "hi", "max_tokens": CONTEXT + 1}, "max_tokens", "context_length_exceeded"),
        ({"prompt": "hi", "max_tokens": 1e20}, "max_tokens", None),
        ({"prompt": "hi", "max_tokens": 2**40}, "max_tokens", None),
        ({"prompt": "hi", "top_k": 2**40}, "top_k", None),
        ({"prompt": "hi", "stop": "x" * 5000}, "stop", None),
    ],
    ids=[
        "prompt-fills-context",
        "max-tokens-past-context",
        "max-tokens-1e20",
        "max-tokens-2e40",
        "top-k",
        "stop",
    ],
)
def test_numbers_no_model_can_serve_are_refused_by_name_before_admission(
    served: Served, body: dict[str, object], param: str, code: str | None
) -> None:
    tenant_id, key = served.new_tenant(f"bounds-n-{uuid.uuid4().hex[:8]}", tier="enterprise")
    r = post(served, key, "/v1/completions", json={"model": MODEL, **body})
    error = assert_error(r, 400, code=code)
    assert error["param"] == param or param in error["message"], error
    assert "x-ratelimit-remaining-tokens" not in r.headers or r.headers["x-ratelimit-remaining-tokens"] != "0"
    assert usage_rows(served, tenant_id) == []


def test_refused_requests_still_count_against_requests_per_minute(served: Served) -> None:
    tenant_id, key = served.new_tenant(f"bounds-rpm-{uuid.uuid4().hex[:8]}", tier="enterprise")
    with served.admin() as admin:
        assert admin.patch(f"/admin/tenants/{tenant_id}", json={"rpm": 3}).status_code == 200
    bad = [
        {"model": MODEL, "prompt": "hi", "no_such_field": 1},  # schema
        {"model": MODEL, "prompt": [5] * CONTEXT},  # context
        {"model": "no-such-model", "prompt": "hi"},  # unknown model
    ]
    for body in bad:
        assert post(served, key, "/v1/completions", json=body).status_code in (400, 404)
    r = post(served, key, "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert_error(r, 429, code="rate_limit_exceeded")
    assert "requests per minute" in r.json()["error"]["message"]


def test_errors_never_echo_unbounded_input(served: Served, tenant: tuple[str, str]) -> None:
    _, key = tenant
    field = "f" * 100_000
    r = post(served, key, "/v1/completions", json={"model": MODEL, "prompt": "hi", field: 1})
    error = assert_error(r, 400)
    assert len(error["message"]) <= 8192 and len(error["param"]) <= 200
    r = post(served, key, "/v1/completions", json={"model": "m" * 100_000, "prompt": "hi"})
    error = assert_error(r, 400, param="model")
    assert len(r.content) < 10_000


def test_an_overloaded_engine_says_so_without_its_internals() -> None:
    from app.errors import to_api_error
    from deployments.engine.errors import EngineOverloaded

    error = to_api_error(EngineOverloaded("37 requests are already waiting"))
    assert error.status == 503 and "37" not in error.message and "waiting" not in error.message
