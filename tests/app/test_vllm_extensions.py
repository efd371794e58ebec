"""vLLM's request extensions through the HTTP API, each honoured (its effect seen in the output), each
bounded (a 400 naming it, nothing billed); and the fields OpenAI's SDKs send by default, accepted.

The tiny model rarely ends by itself, so EOS and stop tokens are made certain with logit_bias: +100 on a
token makes greedy decoding pick it at every step.
"""

import json
from typing import Any

import httpx
import pytest
from openai.types.chat import ChatCompletionMessageParam

from app.served_models.prompts import PromptBuilder
from tests.app.conftest import MODEL, Served
from tests.app.features import MODELS, Account, account_with_adapter, account_without_adapter, assert_refused

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def account(served: Served) -> Account:
    return account_with_adapter(served, "extensions")


@pytest.fixture(scope="module")
def refused(served: Served) -> Account:
    return account_without_adapter(served, "extensions-refused")


@pytest.fixture(scope="module")
def prompts(served: Served) -> PromptBuilder:
    entry = served.services.catalog.get(MODEL)
    assert entry is not None
    return entry.prompts


@pytest.fixture(scope="module")
def eos(prompts: PromptBuilder) -> int:
    token = prompts.tokenizer.eos_token_id
    assert isinstance(token, int)
    return token


def forcing(token: int) -> dict[str, Any]:
    return {"temperature": 0, "logit_bias": {str(token): 100}}


@pytest.mark.parametrize("model", MODELS)
def test_ignore_eos_generates_to_max_tokens(account: Account, eos: int, model: str) -> None:
    ended = account.client.completions.create(model=model, prompt=PROMPT, max_tokens=6, **forcing(eos))
    assert ended.choices[0].finish_reason == "stop" and ended.usage is not None
    assert ended.usage.completion_tokens == 1
    full = account.client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, **forcing(eos), extra_body={"ignore_eos": True}
    )
    assert full.choices[0].finish_reason == "length" and full.usage is not None
    assert full.usage.completion_tokens == 6


@pytest.mark.parametrize("model", MODELS)
def test_min_tokens_holds_eos_back(account: Account, eos: int, model: str) -> None:
    reply = account.client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=12, **forcing(eos), extra_body={"min_tokens": 5}
    )
    # five tokens with EOS masked, then EOS itself (counted, as every sampled token is)
    assert reply.choices[0].finish_reason == "stop" and reply.usage is not None
    assert reply.usage.completion_tokens == 6
    assert reply.choices[0].message.content


def test_min_tokens_defers_stop_strings(account: Account) -> None:
    free = account.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    text = free.choices[0].text
    stop = text[:2]
    assert stop.strip(), text
    cut = account.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == ""
    held = account.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop], extra_body={"min_tokens": 4}
    )
    assert held.usage is not None and held.usage.completion_tokens >= 4
    assert text.startswith(held.choices[0].text) and len(held.choices[0].text) >= len(stop)


@pytest.mark.parametrize("model", MODELS)
def test_stop_token_ids_end_the_output_without_their_text(
    account: Account, prompts: PromptBuilder, model: str
) -> None:
    token = prompts.tokenizer.convert_tokens_to_ids("the")
    if not isinstance(token, int) or token == prompts.tokenizer.unk_token_id:
        token = 100
    free = account.client.completions.create(model=model, prompt=PROMPT, max_tokens=4, **forcing(token))
    assert free.choices[0].finish_reason == "length" and free.choices[0].text
    stopped = account.client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, **forcing(token), extra_body={"stop_token_ids": [token]}
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == ""
    assert stopped.usage is not None and stopped.usage.completion_tokens == 1


def test_skip_special_tokens_false_keeps_eos_in_the_text(
    account: Account, prompts: PromptBuilder, eos: int
) -> None:
    extra = {"ignore_eos": True}
    skipped = account.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, **forcing(eos), extra_body=extra
    )
    assert skipped.choices[0].text == ""
    kept = account.client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=3,
        **forcing(eos),
        extra_body={**extra, "skip_special_tokens": False},
    )
    eos_text = prompts.tokenizer.eos_token
    assert isinstance(eos_text, str) and kept.choices[0].text.count(eos_text) == 3


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(
    served: Served, account: Account, endpoint: str
) -> None:
    """As GuideLLM asks for it: every chunk's usage, rising by one token per chunk, ending at the final
    usage chunk's figures."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    body["ignore_eos"] = True
    if endpoint == "chat":
        body["messages"] = MESSAGES
    else:
        body["prompt"] = PROMPT
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    chunks = sse_chunks(served, account.key, path, body)
    assert chunks and all(c["usage"] is not None for c in chunks)
    generated = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert generated == sorted(generated) and generated[-1] == 8
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 8
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {final["usage"]["prompt_tokens"]}
    for c in chunks:
        assert c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]


def test_without_continuous_usage_stats_only_the_last_chunk_has_usage(
    served: Served, account: Account
) -> None:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = sse_chunks(served, account.key, "/v1/chat/completions", body)
    assert [c["usage"] is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


def sse_chunks(served: Served, key: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks: list[dict[str, Any]] = []
    headers = {"authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{served.url}{path}", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def test_guidellm_style_request_is_served(served: Served, account: Account) -> None:
    """What GuideLLM sends for a fixed output length: ignore_eos with a null stop, both token limits."""
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 5,
        "max_completion_tokens": 5,
        "stop": None,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = sse_chunks(served, account.key, "/v1/chat/completions", body)
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_sdk_default_fields_are_accepted(account: Account) -> None:
    reply = account.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=2,
        store=False,
        metadata={"run": "test"},
        service_tier="auto",
        prompt_cache_key="conversation-1",
        safety_identifier="user-1",
        extra_body={"modalities": ["text"], "reasoning_effort": None},
    )
    assert reply.usage is not None and reply.usage.completion_tokens <= 2
    text = account.client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=2,
        extra_body={"service_tier": "default", "prompt_cache_key": "k"},
    )
    assert text.choices[0].text is not None


def test_responses_take_what_the_sdks_send_and_echo_it(account: Account) -> None:
    """The Agents SDK sends include (empty) on every call, and its model settings' top_logprobs and
    reasoning; the OpenAI SDK's own fields as on chat. Echoed in the response as OpenAI does."""
    reply = account.client.responses.create(
        model=MODEL,
        input="Name three colours.",
        max_output_tokens=2,
        include=[],
        top_logprobs=0,
        reasoning={"effort": None},
        service_tier="auto",
        prompt_cache_key="conversation-1",
        safety_identifier="user-1",
        store=False,
    )
    assert reply.usage is not None and reply.usage.output_tokens <= 2
    assert (reply.prompt_cache_key, reply.safety_identifier, reply.top_logprobs) == (
        "conversation-1",
        "user-1",
        0,
    )


REFUSALS: list[tuple[str, dict[str, Any], str]] = [
    ("stop id past the vocabulary", {"stop_token_ids": [1 << 30]}, "stop_token_ids"),
    ("negative stop id", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("too many stop ids", {"stop_token_ids": list(range(65))}, "stop_token_ids"),
    ("stop ids not a list", {"stop_token_ids": "1,2"}, "stop_token_ids"),
    ("min_tokens past max_tokens", {"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ("negative min_tokens", {"min_tokens": -1}, "min_tokens"),
    ("huge min_tokens", {"min_tokens": 1 << 40}, "min_tokens"),
    ("ignore_eos not a boolean", {"ignore_eos": "yes"}, "ignore_eos"),
    ("skip_special_tokens not a boolean", {"skip_special_tokens": 1}, "skip_special_tokens"),
    (
        "continuous usage without a stream",
        {"stream_options": {"continuous_usage_stats": True}},
        "stream_options",
    ),
    (
        "ignore_eos with json output",
        {"ignore_eos": True, "response_format": {"type": "json_object"}},
        "ignore_eos",
    ),
    (
        "min_tokens with json output",
        {"min_tokens": 2, "response_format": {"type": "json_object"}},
        "min_tokens",
    ),
    ("a reasoning effort", {"reasoning_effort": "high"}, "reasoning_effort"),  # this model does not think
    ("thinking on", {"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
    (
        "a template argument not served",
        {"chat_template_kwargs": {"add_generation_prompt": False}},
        "chat_template_kwargs",
    ),
    ("an unknown service tier", {"service_tier": "gold"}, "service_tier"),
    ("an image modality", {"modalities": ["text", "audio"]}, "modalities"),
    ("an unknown field", {"best_of_luck": 1}, "best_of_luck"),
]


@pytest.mark.parametrize(("fields", "param"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_bad_extensions_are_a_400_naming_the_field(
    served: Served, refused: Account, fields: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"max_tokens": 8, **fields}
    max_tokens = body.pop("max_tokens")
    error = assert_refused(
        served,
        refused,
        lambda: refused.client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=max_tokens, extra_body=body
        ),
        param,
    )
    assert "Traceback" not in error["message"] and "/" not in error["message"].split(":")[0]


def test_min_tokens_past_the_completions_default_is_refused(served: Served, refused: Account) -> None:
    """/v1/completions without max_tokens generates 16 tokens (OpenAI's default): more is a 400."""
    assert_refused(
        served,
        refused,
        lambda: refused.client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"min_tokens": 17}),
        "min_tokens",
    )
