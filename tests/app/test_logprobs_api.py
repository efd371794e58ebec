"""Logprobs through the API: chat's per-token entries with top alternatives, completions' four lists,
echo (with max_tokens 0: the prompt's log-likelihood, as lm-eval asks for it), and logit_bias."""

import math
from typing import Any

import pytest
from openai.types.chat import ChatCompletionMessageParam

from app.served_models.prompts import PromptBuilder
from tests.app.conftest import MODEL, Served
from tests.app.features import MODELS, Account, account_with_adapter, account_without_adapter, assert_refused

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def account(served: Served) -> Account:
    return account_with_adapter(served, "logprobs")


@pytest.fixture(scope="module")
def prompts(served: Served) -> PromptBuilder:
    entry = served.services.catalog.get(MODEL)
    assert entry is not None
    return entry.prompts


def assert_logprob(value: float | None) -> None:
    assert value is not None and math.isfinite(value) and value <= 0.0


@pytest.mark.parametrize("model", MODELS)
def test_chat_logprobs_have_one_entry_per_token_with_the_top_alternatives(
    account: Account, model: str
) -> None:
    reply = account.client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = reply.choices[0]
    assert reply.usage is not None and choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert len(entries) == reply.usage.completion_tokens
    for entry in entries:
        assert_logprob(entry.logprob)
        assert entry.bytes is not None and len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        # greedy picks the likeliest token (no penalties here): the first alternative, with its logprob
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    text = b"".join(bytes(e.bytes or []) for e in entries).decode(errors="replace")
    assert choice.message.content is not None and text.startswith(choice.message.content)


def test_chat_logprobs_without_top_logprobs_have_no_alternatives(account: Account) -> None:
    reply = account.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True
    )
    assert reply.choices[0].logprobs is not None and reply.choices[0].logprobs.content
    assert all(e.top_logprobs == [] for e in reply.choices[0].logprobs.content)
    plain = account.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0
    )
    assert plain.choices[0].logprobs is None


def test_streamed_chat_logprobs_equal_the_whole_ones(account: Account) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    whole = account.client.chat.completions.create(**kwargs)
    streamed = []
    for chunk in account.client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                streamed += choice.logprobs.content
    assert whole.choices[0].logprobs is not None and whole.choices[0].logprobs.content is not None
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in whole.choices[0].logprobs.content
    ]


@pytest.mark.parametrize("model", MODELS)
def test_completion_logprobs_have_the_four_lists(account: Account, model: str) -> None:
    reply = account.client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None and reply.usage is not None
    lp = choice.logprobs
    assert lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == reply.usage.completion_tokens
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert_logprob(value)
        assert top is not None and 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy: the likeliest
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    whole = []  # up to the first token that holds part of a character (written as `bytes:\\x..`)
    for token in lp.tokens:
        if token.startswith("bytes:"):
            break
        whole.append(token)
    assert choice.text.startswith("".join(whole))


def test_echo_with_max_tokens_0_returns_the_prompts_logprobs(
    account: Account, prompts: PromptBuilder
) -> None:
    reply = account.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = reply.choices[0]
    assert choice.text == PROMPT
    assert reply.usage is not None and reply.usage.completion_tokens == 0
    ids = prompts.completion(PROMPT)
    assert reply.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert (
        lp is not None
        and lp.tokens is not None
        and lp.token_logprobs is not None
        and lp.top_logprobs is not None
    )
    assert "".join(lp.tokens) == PROMPT and len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for value in lp.token_logprobs[1:]:
        assert_logprob(value)
    assert lp.text_offset == [
        PROMPT.index(t, o) if t else o for t, o in zip(lp.tokens, lp.text_offset, strict=True)
    ]


def test_echo_puts_the_prompt_before_the_completion(account: Account) -> None:
    plain = account.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0
    )
    echoed = account.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    lp, plain_lp = echoed.choices[0].logprobs, plain.choices[0].logprobs
    assert lp is not None and plain_lp is not None and lp.tokens is not None and plain_lp.tokens is not None
    assert lp.tokens[-len(plain_lp.tokens) :] == plain_lp.tokens
    streamed = "".join(
        c.choices[0].text
        for c in account.client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, stream=True
        )
        if c.choices
    )
    assert streamed == echoed.choices[0].text


def test_logit_bias_of_100_makes_greedy_output_that_token(account: Account, prompts: PromptBuilder) -> None:
    free = account.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    token = prompts.completion(" river")
    assert len(token) == 1
    biased = account.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={str(token[0]): 100}
    )
    assert biased.choices[0].text == " river" * 4 != free.choices[0].text
    chat = account.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, logit_bias={str(token[0]): 100}
    )
    assert chat.choices[0].message.content == " river" * 3


@pytest.fixture(scope="module")
def refused(served: Served) -> Account:
    return account_without_adapter(served, "logprobs-refused")


CHAT_REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("top-logprobs-without-logprobs", {"top_logprobs": 2}, "top_logprobs"),
    ("top-logprobs-with-logprobs-false", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ("top-logprobs-21", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("logit-bias-out-of-vocab", {"logit_bias": {"2048": 5}}, "logit_bias"),
    ("logit-bias-not-an-id", {"logit_bias": {"hello": 5}}, "logit_bias"),
    ("logit-bias-negative-id", {"logit_bias": {"-1": 5}}, "logit_bias"),
    ("logit-bias-over-100", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("logit-bias-too-many", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
]


@pytest.mark.parametrize(("body", "param"), [r[1:] for r in CHAT_REFUSED], ids=[r[0] for r in CHAT_REFUSED])
def test_bad_chat_logprobs_and_biases_are_400(
    served: Served, refused: Account, body: dict[str, Any], param: str
) -> None:
    def call() -> object:
        return refused.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **body)

    assert_refused(served, refused, call, param)


COMPLETION_REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("max-tokens-0-without-echo", {"max_tokens": 0}, "max_tokens"),
    ("logprobs-6", {"logprobs": 6}, "logprobs"),
    ("logprobs-negative", {"logprobs": -1}, "logprobs"),
    ("logit-bias-out-of-vocab", {"logit_bias": {"99999": 1}}, "logit_bias"),
]


@pytest.mark.parametrize(
    ("body", "param"), [r[1:] for r in COMPLETION_REFUSED], ids=[r[0] for r in COMPLETION_REFUSED]
)
def test_bad_completion_logprobs_are_400(
    served: Served, refused: Account, body: dict[str, Any], param: str
) -> None:
    def call() -> object:
        return refused.client.completions.create(model=MODEL, prompt=PROMPT, **{"max_tokens": 2, **body})

    assert_refused(served, refused, call, param)
