"""A thinking model through the API with the OpenAI SDK: its reasoning separated from its answer on chat
(`reasoning_content`, streamed as `delta.reasoning_content`) and on Responses (a reasoning item), reasoning
tokens counted, and thinking switched by `chat_template_kwargs.enable_thinking` or the reasoning effort.

The model (tests/app/chat_families.py) greedily writes `<think> plan first</think> answer` and ends."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.app.chat_families import build_thinker
from tests.app.conftest import MODEL, Served, serving
from tests.app.features import Account, account_without_adapter, assert_refused
from tests.model_fixtures import TinySetup

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
REASONING, ANSWER = "plan first", "answer"
THOUGHT_TOKENS = 4  # <think>, " plan", " first", </think>
OUTPUT_TOKENS = 6  # and " answer", <|im_end|>
OFF_PROMPT = 6  # tokens the template adds with thinking off: <think>\n\n</think>\n\n


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("thinker")
    model_dir = build_thinker(root)
    (root / "store").mkdir()
    setup = TinySetup("llama", model_dir, root / "store", {}, {})
    with serving(setup, tmp_path_factory.mktemp("app")) as app:
        yield app


@pytest.fixture(scope="module")
def account(served: Served) -> Account:
    return account_without_adapter(served, "thinker")


def chat(account: Account, **fields: Any) -> Any:
    fields.setdefault("max_tokens", 16)
    return account.client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, **fields)


def test_chat_separates_reasoning_from_the_answer_and_counts_its_tokens(account: Account) -> None:
    reply = chat(account)
    message = reply.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content") == REASONING
    assert message.content == ANSWER and reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens == OUTPUT_TOKENS
    assert reply.usage.completion_tokens_details is not None
    assert reply.usage.completion_tokens_details.reasoning_tokens == THOUGHT_TOKENS


def test_a_stream_sends_reasoning_deltas_then_content_and_no_tag(account: Account) -> None:
    chunks = list(chat(account, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thoughts = [(d.model_extra or {}).get("reasoning_content") for d in deltas]
    contents = [d.content for d in deltas]
    assert "".join(t for t in thoughts if t) == REASONING
    assert "".join(c for c in contents if c) == ANSWER
    first_content = next(n for n, c in enumerate(contents) if c)
    assert not any(thoughts[first_content:]), "reasoning after the answer began"
    assert not any("<" in (t or "") + (c or "") for t, c in zip(thoughts, contents, strict=True))
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == THOUGHT_TOKENS


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_cut_by_max_tokens_is_all_reasoning(account: Account, stream: bool) -> None:
    if not stream:
        reply = chat(account, max_tokens=3)
        message = reply.choices[0].message
        assert ((message.model_extra or {}).get("reasoning_content"), message.content) == (REASONING, None)
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens_details.reasoning_tokens == 3
        return
    chunks = list(chat(account, max_tokens=3, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == REASONING
    assert not any(d.content for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "switch",
    [{"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}],
    ids=["enable_thinking", "effort-none"],
)
def test_thinking_off_changes_the_prompt_and_leaves_the_output_unsplit(
    account: Account, switch: dict[str, Any]
) -> None:
    """The template renders its empty thinking block; the output is all content (vLLM's behaviour with
    enable_thinking false), here the tags this model writes whatever its prompt."""
    on = chat(account)
    off = chat(account, extra_body=switch)
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + OFF_PROMPT
    message = off.choices[0].message
    assert message.content == f"<think> {REASONING}</think> {ANSWER}"
    assert (message.model_extra or {}).get("reasoning_content") is None
    assert off.usage.completion_tokens_details is None


def test_an_assistant_turn_sent_back_with_its_reasoning_renders_without_it(account: Account) -> None:
    turn: dict[str, Any] = {"role": "assistant", "content": ANSWER}
    follow = [*MESSAGES, turn, {"role": "user", "content": "more"}]
    plain = account.client.chat.completions.create(model=MODEL, messages=cast(Any, follow), max_tokens=1)
    turn["reasoning_content"] = REASONING
    replayed = account.client.chat.completions.create(model=MODEL, messages=cast(Any, follow), max_tokens=1)
    assert replayed.usage is not None and plain.usage is not None
    assert replayed.usage.prompt_tokens == plain.usage.prompt_tokens


def test_an_effort_turns_thinking_on_as_the_template_default_does(account: Account) -> None:
    reply = chat(
        account, reasoning_effort="high", extra_body={"chat_template_kwargs": {"enable_thinking": True}}
    )
    assert reply.usage.prompt_tokens == chat(account).usage.prompt_tokens
    assert (reply.choices[0].message.model_extra or {}).get("reasoning_content") == REASONING


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}}, "reasoning_effort"),
        ({"reasoning_effort": "high", "response_format": {"type": "json_object"}}, "reasoning_effort"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ],
    ids=["contradiction", "thinking-under-a-grammar", "unknown-template-argument"],
)
def test_what_cannot_be_honoured_is_a_400_naming_its_field(
    served: Served, fields: dict[str, Any], param: str
) -> None:
    refused = account_without_adapter(served, "thinker-refused")  # never has a usage row
    assert_refused(served, refused, lambda: chat(refused, extra_body=fields), param)


def test_a_grammar_turns_thinking_off_by_default(account: Account) -> None:
    """A response_format constrains the whole output: the prompt is rendered with thinking off."""
    on = chat(account)
    reply = chat(account, response_format={"type": "json_object"}, max_tokens=24)
    assert reply.usage.prompt_tokens == on.usage.prompt_tokens + OFF_PROMPT
    assert (reply.choices[0].message.model_extra or {}).get("reasoning_content") is None


# -- Responses -------------------------------------------------------------------------------------------


def test_a_response_has_a_reasoning_item_before_its_message(account: Account) -> None:
    reply = account.client.responses.create(model=MODEL, input="hi", temperature=0, max_output_tokens=16)
    assert [item.type for item in reply.output] == ["reasoning", "message"]
    reasoning = reply.output[0]
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content or []] == [("reasoning_text", REASONING)]
    assert reply.output_text == ANSWER
    assert reply.usage is not None and reply.usage.output_tokens_details.reasoning_tokens == THOUGHT_TOKENS

    # Sent back (a stored chain, or the items replayed by hand), reasoning renders nothing.
    plain = account.client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "hi"}],
        temperature=0,
        max_output_tokens=16,
        store=False,
    )
    replayed = account.client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "hi"}, cast(Any, reasoning.model_dump(exclude_none=True))],
        temperature=0,
        max_output_tokens=16,
        store=False,
    )
    assert replayed.usage is not None and plain.usage is not None
    assert replayed.usage.input_tokens == plain.usage.input_tokens
    follow = account.client.responses.create(
        model=MODEL, input="more", previous_response_id=reply.id, temperature=0, max_output_tokens=16
    )
    assert follow.output_text == ANSWER


def test_a_response_stream_sends_reasoning_text_events(account: Account) -> None:
    events = list(
        account.client.responses.create(
            model=MODEL, input="hi", temperature=0, max_output_tokens=16, stream=True
        )
    )
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == REASONING
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert done.text == REASONING
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1]
    assert final.type == "response.completed"
    assert [item.type for item in final.response.output] == ["reasoning", "message"]
    assert final.response.usage is not None
    assert final.response.usage.output_tokens_details.reasoning_tokens == THOUGHT_TOKENS


def test_a_response_without_thinking_has_no_reasoning_item(account: Account) -> None:
    reply = account.client.responses.create(
        model=MODEL, input="hi", temperature=0, max_output_tokens=16, reasoning={"effort": "none"}
    )
    assert [item.type for item in reply.output] == ["message"]
    assert reply.reasoning is not None and reply.reasoning.effort == "none"


def test_a_response_cut_while_thinking_is_incomplete_reasoning(account: Account) -> None:
    reply = account.client.responses.create(model=MODEL, input="hi", temperature=0, max_output_tokens=3)
    assert reply.status == "incomplete" and [item.type for item in reply.output] == ["reasoning"]
    assert reply.output[0].type == "reasoning" and reply.output[0].status == "incomplete"


def test_models_without_thinking_refuse_reasoning(served: Served, tmp_path: Path, llama: TinySetup) -> None:
    """Kept from before: the demo models' templates do not think (tests/app/test_vllm_extensions.py runs the
    chat refusals); the Responses effort is named as Responses names it."""
    with serving(llama, tmp_path) as plain:
        refused = account_without_adapter(plain, "plain")

        def call() -> object:
            return refused.client.responses.create(model=MODEL, input="hi", reasoning={"effort": "high"})

        assert_refused(plain, refused, call, "reasoning.effort")
