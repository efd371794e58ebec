"""Tool calls in each family's own format: a model whose chat template is Phi-4-mini's writes its calls as
`<|tool_call|>[...]<|/tool_call|>` (the grammar constrains it to that) and the SDK reads them back as
`tool_calls`, whole or streamed, with no piece of a block leaking as content."""

import json
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from app.completions import tool_calls
from app.completions.tool_calls import ToolCallStream, parse
from app.schemas.openai import ChatCompletionRequest
from app.served_models.chat_format import HERMES, PHI4
from tests.app.chat_families import PHI4_TEMPLATE, with_template
from tests.app.conftest import MODEL, Served, serving
from tests.app.features import Account, account_without_adapter
from tests.model_fixtures import TinySetup

CLOCK: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What time is it in Oslo?"}]
NAMES = frozenset({"get_time", "get_weather"})


def test_phi4_blocks_hold_a_list_of_calls() -> None:
    text = (
        'Sure. <|tool_call|>[{"name": "get_time", "arguments": {"city": "Oslo"}}, '
        '{"name": "get_weather", "arguments": "{}"}]<|/tool_call|>'
    )
    content, calls = parse(text, NAMES, PHI4)
    assert content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"city": "Oslo"}),
        ("get_weather", {}),
    ]
    # A block with a bad call, an empty list, or another family's format stays content, as written.
    for kept in (
        '<|tool_call|>[{"name": "get_time"}, {"name": "nope"}]<|/tool_call|>',
        "<|tool_call|>[]<|/tool_call|>",
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    ):
        assert parse(kept, NAMES, PHI4) == (kept, [])
    assert parse('<|tool_call|>{"name": "get_time", "arguments": {}}<|/tool_call|>', NAMES, PHI4)[1]


def test_a_phi4_stream_never_leaks_a_block_and_equals_the_whole_parse() -> None:
    text = (
        'a <|tool_call|>[{"name": "get_time", "arguments": {}}]<|/tool_call|> '
        "b <|tool_call|>[oops]<|/tool_call|>"
    )
    for size in (1, 3, 7):
        stream = ToolCallStream(NAMES, PHI4)
        events: list[Any] = []
        for start in range(0, len(text), size):
            events += stream.feed(text[start : start + size])
        events += stream.finish()
        content = "".join(e for e in events if isinstance(e, str))
        assert content == parse(text, NAMES, PHI4)[0]
        assert "<|tool_call|>[{" not in content and stream.calls == 1


def test_the_grammar_writes_the_models_own_format() -> None:
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": MESSAGES, "tools": [CLOCK], "tool_choice": "required"}
    )
    structured = tool_calls.plan(body, PHI4).structured
    assert structured is not None and (structured.begin, structured.end) == (
        "<|tool_call|>[",
        "]<|/tool_call|>",
    )
    hermes = tool_calls.plan(body, HERMES).structured
    assert hermes is not None and (hermes.begin, hermes.end) == ("<tool_call>", "</tool_call>")


@pytest.fixture(scope="module")
def served(llama: TinySetup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model_dir = tmp_path_factory.mktemp("phi4") / "model"
    shutil.copytree(llama.model_dir, model_dir)
    with_template(model_dir, PHI4_TEMPLATE)
    setup = TinySetup(llama.arch, model_dir, llama.store_root, llama.adapter_dirs, llama.refs)
    with serving(setup, tmp_path_factory.mktemp("app")) as app:
        yield app


@pytest.fixture(scope="module")
def account(served: Served) -> Account:
    return account_without_adapter(served, "phi4")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_phi4_model_calls_tools_in_its_format(account: Account, choice: Any) -> None:
    reply = account.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[CLOCK], tool_choice=choice, max_tokens=64, seed=1
    )
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    assert message.tool_calls and message.tool_calls[0].type == "function"
    call = message.tool_calls[0].function
    assert call.name == "get_time" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")


def test_a_streamed_phi4_call_arrives_whole_with_no_content(account: Account) -> None:
    chunks = list(
        account.client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=[CLOCK],
            tool_choice="required",
            max_tokens=64,
            seed=2,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)  # the block never leaks as text
    calls = [call for d in deltas for call in d.tool_calls or ()]
    assert calls and calls[0].function is not None and calls[0].function.name == "get_time"
    arguments = "".join(c.function.arguments or "" for c in calls if c.function is not None)
    assert json.loads(arguments)["city"] in ("Paris", "Oslo")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
