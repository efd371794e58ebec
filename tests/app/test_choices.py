"""Several choices in one request: n, a list of prompts (OpenAI's index order), seeds, usage, streaming,
and a rate-limit reservation that counts every choice."""

import asyncio
import time
import uuid
from typing import Any

import httpx
import pytest
from openai.types.chat import ChatCompletionMessageParam

from app.limits import Limits
from app.served_models.prompts import PromptBuilder
from tests.app.conftest import MODEL, Served
from tests.app.features import MODELS, Account, account_with_adapter, account_without_adapter, assert_refused
from tests.app.test_rate_limits import make_tier

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story."}]
PROMPTS = ["The sea is", "Once upon a time, in a"]


@pytest.fixture(scope="module")
def account(served: Served) -> Account:
    return account_with_adapter(served, "choices")


@pytest.fixture(scope="module")
def prompts(served: Served) -> PromptBuilder:
    entry = served.services.catalog.get(MODEL)
    assert entry is not None
    return entry.prompts


@pytest.mark.parametrize("model", MODELS)
def test_n_choices_with_a_seed_are_reproducible(account: Account, model: str) -> None:
    kwargs: dict[str, Any] = dict(model=model, messages=MESSAGES, max_tokens=8, n=3, seed=42, temperature=1.0)
    first = account.client.chat.completions.create(**kwargs)
    again = account.client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1  # n independent samples, not one copied
    assert all(c.finish_reason in ("stop", "length") for c in first.choices)
    single = account.client.chat.completions.create(**{**kwargs, "n": 1})
    assert first.usage is not None and single.usage is not None
    assert first.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    assert first.usage.completion_tokens <= 3 * 8


def test_streamed_choices_assemble_to_the_whole_ones(account: Account) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, max_tokens=8, n=3, seed=7)
    whole = account.client.chat.completions.create(**kwargs)
    texts = {i: "" for i in range(3)}
    reasons: dict[int, str | None] = {}
    roles = set()
    for chunk in account.client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            if choice.delta.role:
                roles.add(choice.index)
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert roles == {0, 1, 2}
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert [reasons[i] for i in range(3)] == [c.finish_reason for c in whole.choices]


def test_a_prompt_list_with_n_2_is_in_openais_order(account: Account, prompts: PromptBuilder) -> None:
    reply = account.client.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=6, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    singles = [
        account.client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text
        for p in PROMPTS
    ]
    assert [c.text for c in reply.choices] == [singles[0], singles[0], singles[1], singles[1]]
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == sum(len(prompts.completion(p)) for p in PROMPTS)
    by_ids = account.client.completions.create(
        model=MODEL, prompt=[prompts.completion(p) for p in PROMPTS], max_tokens=6, temperature=0
    )
    assert [c.text for c in by_ids.choices] == singles
    streamed: dict[int, str] = {}
    for chunk in account.client.completions.create(
        model=MODEL, prompt=PROMPTS, n=2, max_tokens=6, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(4)] == [c.text for c in reply.choices]


def test_echo_of_a_prompt_list_echoes_each_prompt(account: Account) -> None:
    reply = account.client.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=0, echo=True)
    assert [c.text for c in reply.choices] == [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]


def test_the_reservation_counts_every_choice(served: Served) -> None:
    """Prompt + n * max_tokens must fit the tier's TPM: n=1 does, n=8 of the same request does not."""
    _, key = served.new_tenant(f"n-{uuid.uuid4().hex[:8]}", tier=make_tier(served, tpm=300))
    headers = {"authorization": f"Bearer {key}"}
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 60, "temperature": 0}
    one = httpx.post(f"{served.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert one.status_code == 200, one.text
    many = httpx.post(f"{served.url}/v1/completions", json={**body, "n": 8}, headers=headers, timeout=60)
    assert many.status_code == 429 and many.json()["error"]["code"] == "request_too_large", many.text
    listed = {**body, "prompt": ["hello"] * 8}
    r = httpx.post(f"{served.url}/v1/completions", json=listed, headers=headers, timeout=60)
    assert r.status_code == 429 and r.json()["error"]["code"] == "request_too_large", r.text


@pytest.fixture(scope="module")
def refused(served: Served) -> Account:
    return account_without_adapter(served, "choices-refused")


def test_n_over_the_deployments_limit_is_400(served: Served, refused: Account) -> None:
    limit = served.services.settings.max_n
    assert_refused(
        served,
        refused,
        lambda: refused.client.chat.completions.create(
            model=MODEL, messages=MESSAGES, n=limit + 1, max_tokens=2
        ),
        "n",
    )
    assert_refused(
        served,
        refused,
        lambda: refused.client.completions.create(model=MODEL, prompt="hi", n=1000, max_tokens=2),
        "n",
    )


def test_too_many_prompts_and_empty_ones_are_400(served: Served, refused: Account) -> None:
    limit = served.services.settings.max_prompts
    assert_refused(
        served,
        refused,
        lambda: refused.client.completions.create(model=MODEL, prompt=["a"] * (limit + 1), max_tokens=1),
        "prompt",
    )
    for empty in ([], ["a", ""], [[1], []]):

        def call(prompt: Any = empty) -> object:
            return refused.client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)

        assert_refused(served, refused, call, "prompt")


def _sequence_tenant(served: Served, **limits: object) -> tuple[str, dict[str, str], str]:
    tier = make_tier(served, **limits)
    tenant_id, key = served.new_tenant(f"seq-{uuid.uuid4().hex[:8]}", tier=tier)
    return tenant_id, {"authorization": f"Bearer {key}"}, tier


def test_more_sequences_than_the_tier_runs_are_refused_at_once(served: Served) -> None:
    """Concurrency counts sequences: 2 prompts x n=3 is 6, more than a tier of 4 ever runs at once. A 400
    naming n x prompts and the cap comes at once, though the tier queues (no wait could make room)."""
    tenant_id, headers, tier = _sequence_tenant(
        served, max_concurrent=4, on_limit="queue", max_queue_ms=20_000
    )
    body = {"model": MODEL, "prompt": PROMPTS, "n": 3, "max_tokens": 2, "temperature": 0}
    started = time.monotonic()
    r = httpx.post(f"{served.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 400 and time.monotonic() - started < 10, r.text
    error = r.json()["error"]
    assert error["param"] == "n" and error["code"] == "too_many_sequences"
    assert "n (3) x prompts (2) = 6 sequences" in error["message"]
    assert f"tier {tier} runs at most 4 sequences at once" in error["message"]
    state = asyncio.run(served.services.limiter.peek(tenant_id))
    assert state.in_flight == 0 and state.queued == 0
    fits = httpx.post(f"{served.url}/v1/completions", json={**body, "n": 2}, headers=headers, timeout=60)
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 4, fits.text


def test_more_sequences_than_the_model_runs_per_request_are_refused(served: Served) -> None:
    """Unlimited tiers too: one request runs at most the engine's max_num_seqs sequences."""
    _, headers, _ = _sequence_tenant(served)
    cap = served.services.catalog.get(MODEL).spec.max_num_seqs  # type: ignore[union-attr]
    body = {"model": MODEL, "prompt": ["hi"] * cap, "n": 2, "max_tokens": 1}
    r = httpx.post(f"{served.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sequences", r.text
    assert f"n (2) x prompts ({cap}) = {2 * cap} sequences" in r.json()["error"]["message"]
    assert f"at most {cap} sequences" in r.json()["error"]["message"]


def test_the_concurrency_lease_weighs_every_sequence(served: Served) -> None:
    """With 2 of a tier's 4 sequences held elsewhere, n=3 does not fit but n=2 does, and gives its 2 back."""
    tenant_id, headers, _ = _sequence_tenant(served, max_concurrent=4)
    limiter = served.services.limiter
    held = asyncio.run(limiter.admit(tenant_id, "other-replica", Limits(max_concurrent=4), 1, sequences=2))
    assert held.admitted
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0}
    wide = httpx.post(f"{served.url}/v1/completions", json={**body, "n": 3}, headers=headers, timeout=60)
    assert wide.status_code == 429 and "concurrent" in wide.json()["error"]["message"], wide.text
    fits = httpx.post(f"{served.url}/v1/completions", json={**body, "n": 2}, headers=headers, timeout=60)
    assert fits.status_code == 200, fits.text
    assert asyncio.run(limiter.peek(tenant_id)).in_flight == 2  # its own two released, the others' held


def test_echo_with_logprobs_gives_every_choice_the_prompts_logprobs(
    account: Account, prompts: PromptBuilder
) -> None:
    """Echo + logprobs with n = 3 and output to generate: the prompt's logprobs (computed once, by the first
    choice) lead each choice's logprobs, the same in all three."""
    ids = prompts.completion(PROMPTS[1])
    reply = account.client.completions.create(
        model=MODEL, prompt=PROMPTS[1], n=3, max_tokens=3, echo=True, logprobs=1, seed=5
    )
    heads: list[list[float | None]] = []
    for choice in reply.choices:
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
        assert choice.text.startswith(PROMPTS[1]) and len(lp.tokens) >= len(ids)
        head = lp.token_logprobs[: len(ids)]
        assert head[0] is None and all(value is not None and value <= 0 for value in head[1:]), head
        heads.append(head)
    assert heads[1] == heads[0] and heads[2] == heads[0]
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
