"""Tools: the chat template renders them, tool_choice required / named constrains decoding to calls that
the SDK reads back (streamed or not), auto output is parsed, and an agent loop's tool results render."""

import json
import shutil
from pathlib import Path
from typing import Any, cast

import httpx
import jsonschema
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from app.errors import InvalidParameter
from app.prompts import PromptBuilder
from app.schemas.openai import ChatMessage
from app.tool_calls import BEGIN, END, ToolCallStream, parse
from tests.app.conftest import MODEL, Served
from tests.app.features import MODELS, Account, account_with_adapter, account_without_adapter, assert_refused

WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK: ChatCompletionToolParam = {
    "type": "function",
    "function": {"name": "get_time", "description": "The time now."},  # no parameters: no arguments
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {
    "get_weather": WEATHER["function"]["parameters"],
    "get_time": {"type": "object", "properties": {}, "additionalProperties": False},
}
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
MAX_TOKENS = 128  # one call is about 60 tokens of the demo tokenizer


@pytest.fixture(scope="module")
def account(served: Served) -> Account:
    return account_with_adapter(served, "tools")


def assert_calls(calls: Any, names: set[str]) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# -- the parser ---------------------------------------------------------------------------------------

NAMES = frozenset({"get_weather", "get_time"})


def test_parse_takes_well_formed_calls_of_known_tools_and_leaves_the_rest() -> None:
    text = (
        'Sure.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = parse(text, NAMES)
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert content == 'Sure.\n<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    assert parse("just text", NAMES) == ("just text", [])
    assert parse(f'{BEGIN}{{"name": "get_time", "arguments": {{}}}}{END}', NAMES)[0] is None
    assert parse(f"{BEGIN}not json{END}", NAMES) == (f"{BEGIN}not json{END}", [])
    # arguments given as a JSON string are read too
    _, calls = parse(f'{BEGIN}{{"name": "get_time", "arguments": "{{}}"}}{END}', NAMES)
    assert calls[0].arguments == "{}"


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_the_stream_parser_agrees_with_the_whole_one_and_never_leaks_a_tag(step: int) -> None:
    text = (
        'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
        "<tool_call>broken</tool_call> and a < sign <tool_ca"
    )
    stream = ToolCallStream(NAMES)
    events = []
    for i in range(0, len(text), step):
        events += stream.feed(text[i : i + step])
        streamed = "".join(e for e in events if isinstance(e, str))
        assert "<tool_call>{" not in streamed
    events += stream.finish()
    content = "".join(e for e in events if isinstance(e, str))
    whole_content, whole_calls = parse(text, NAMES)
    assert content == whole_content
    assert [(c.name, c.arguments) for c in events if not isinstance(c, str)] == [
        (c.name, c.arguments) for c in whole_calls
    ]


def test_whitespace_between_calls_is_no_content() -> None:
    stream = ToolCallStream(NAMES)
    call = f'{BEGIN}{{"name": "get_time", "arguments": {{}}}}{END}'
    events = stream.feed(call + "\n") + stream.feed(call) + stream.finish()
    assert [e for e in events if isinstance(e, str)] == []
    assert parse(call + "\n" + call, NAMES)[0] is None


# -- the template -------------------------------------------------------------------------------------


def test_the_template_renders_tools_calls_and_results(served: Served) -> None:
    prompts = PromptBuilder(served.setup.model_dir)
    messages = [
        ChatMessage(role="user", content="Weather?"),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            }
        ),
        ChatMessage(role="tool", tool_call_id="call_1", content="sunny, 20 c"),
    ]
    ids = prompts.chat(messages, [dict(t) for t in TOOLS])
    text = str(prompts.tokenizer.decode(ids))
    assert "<tools>\n" + json.dumps(WEATHER) in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\n<tool_response>sunny, 20 c</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert "<tools>" not in str(prompts.tokenizer.decode(prompts.chat(messages[:1])))


def test_a_template_without_tools_refuses_them(served: Served, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copyfile(served.setup.model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    prompts = PromptBuilder(tmp_path)
    assert prompts.chat([ChatMessage(role="user", content="hi")])
    with pytest.raises(InvalidParameter) as raised:
        prompts.chat([ChatMessage(role="user", content="hi")], [dict(WEATHER)])
    assert raised.value.param == "tools"


# -- through the API ----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_required_tool_choice_returns_calls_of_the_tools(account: Account, model: str) -> None:
    reply = account.client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS, seed=3
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    assert_calls(choice.message.tool_calls, {"get_weather", "get_time"})


def test_a_named_function_is_the_one_called_once(account: Account) -> None:
    reply = account.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    calls = reply.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1
    assert_calls(calls, {"get_weather"})


def test_without_parallel_calls_there_is_one_call(account: Account) -> None:
    reply = account.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        seed=5,
    )
    calls = reply.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1


@pytest.mark.parametrize("model", MODELS)
def test_streamed_calls_are_assembled_by_the_sdk_as_the_whole_ones(account: Account, model: str) -> None:
    kwargs: dict[str, Any] = dict(
        model=model,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    whole = account.client.chat.completions.create(**kwargs)
    with account.client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion()
    calls = streamed.choices[0].message.tool_calls
    assert_calls(calls, {"get_weather"})
    assert calls is not None and whole.choices[0].message.tool_calls is not None
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
    ]
    assert streamed.choices[0].finish_reason == "tool_calls"
    assert not streamed.choices[0].message.content


def test_raw_stream_chunks_name_a_call_then_send_its_arguments(served: Served, account: Account) -> None:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": MAX_TOKENS,
        "seed": 11,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {account.key}"}
    pieces = []
    with httpx.stream(
        "POST", f"{served.url}/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                pieces += [c["delta"] for c in json.loads(line[6:])["choices"]]
    calls = [d["tool_calls"] for d in pieces if d.get("tool_calls")]
    assert calls and all(len(c) == 1 for c in calls)
    first, second = calls[0][0], calls[1][0]
    assert set(first) == {"index", "id", "type", "function"} and first["function"]["arguments"] == ""
    assert set(second) == {"index", "function"} and set(second["function"]) == {"arguments"}
    assert not any(d.get("content") for d in pieces)


def test_an_agent_loop_sends_the_result_back_and_gets_an_answer(served: Served, account: Account) -> None:
    first = account.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS, seed=1
    )
    message = first.choices[0].message
    assert message.tool_calls
    results: list[ChatCompletionMessageParam] = [
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}
        for call in message.tool_calls
    ]
    history: list[ChatCompletionMessageParam] = [
        *MESSAGES,
        message.model_dump(exclude_none=True),  # type: ignore[list-item]
        *results,
    ]
    final = account.client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    entry = served.services.catalog.get(MODEL)
    assert entry is not None
    rendered = entry.prompts.chat([ChatMessage.model_validate(m) for m in history], [dict(t) for t in TOOLS])
    assert final.usage is not None and final.usage.prompt_tokens == len(rendered)
    text = str(entry.prompts.tokenizer.decode(rendered))
    assert text.count("<tool_response>") == len(results)
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name in text.split("<|im_start|>assistant\n")[1]


def test_auto_tool_choice_leaves_a_random_models_text_as_content(account: Account) -> None:
    reply = account.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=12, temperature=0
    )
    plain = account.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=12, temperature=0
    )
    assert reply.choices[0].message.content == plain.choices[0].message.content
    assert reply.choices[0].message.tool_calls is None


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    (
        "unknown-named-tool",
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
        "tool_choice",
    ),
    ("required-without-tools", {"tool_choice": "required"}, "tool_choice"),
    (
        "response-format-with-required",
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
    ),
    (
        "bad-tool-name",
        {"tools": [{"type": "function", "function": {"name": "a b"}}]},
        "tools.0.function.name",
    ),
    ("duplicate-tools", {"tools": [CLOCK, CLOCK]}, "tools"),
    (
        "too-many-tools",
        {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
        "tools",
    ),
    ("bad-tool-type", {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ("bad-tool-choice", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
]


@pytest.fixture(scope="module")
def refused(served: Served) -> Account:
    return account_without_adapter(served, "tools-refused")


@pytest.mark.parametrize(("body", "param"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_bad_tools_are_400_naming_the_field_and_bill_nothing(
    served: Served, refused: Account, body: dict[str, Any], param: str
) -> None:
    def call() -> object:
        return refused.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **body)

    assert_refused(served, refused, call, param)


@pytest.mark.parametrize(
    "message",
    [
        {"role": "tool", "content": "x"},  # no tool_call_id
        {"role": "user", "content": "x", "tool_call_id": "c"},
        {"role": "user", "content": None},
        {
            "role": "user",
            "content": "x",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
    ],
    ids=["tool-without-id", "user-with-call-id", "user-without-content", "user-with-calls"],
)
def test_malformed_tool_messages_are_400(served: Served, refused: Account, message: dict[str, Any]) -> None:
    def call() -> object:
        return refused.client.chat.completions.create(
            model=MODEL, messages=[*MESSAGES, cast(ChatCompletionMessageParam, message)], max_tokens=4
        )

    assert_refused(served, refused, call, "messages.2")
