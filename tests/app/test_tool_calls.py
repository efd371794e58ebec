"""Tools: the chat template renders them, tool_choice required / named constrains decoding to calls that
the SDK reads back (streamed or not), auto output is parsed, and an agent loop's tool results render."""

import json
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import httpx
import jsonschema
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from openai.types.shared_params import ResponseFormatJSONSchema

from app.completions import chat_renderer, rendering, tool_calls
from app.completions.chat_renderer import ChatRenderer
from app.completions.plan import Shape
from app.completions.rendering import HEAVY_BLOCKS, HEAVY_CHARS
from app.completions.tool_calls import BEGIN, END, ParsedCall, ToolCallStream, parse
from app.errors import InvalidParameter
from app.schemas.openai import ChatChoice, ChatMessage
from app.served_models.prompts import PromptBuilder
from deployments.engine.interface import FinishReason, RequestOutput
from tests.app.conftest import MODEL, Served
from tests.app.features import (
    MODELS,
    Account,
    account_with_adapter,
    account_without_adapter,
    assert_refused,
    best_of,
)
from tests.model_fixtures import TinySetup

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


def streamed(text: str, step: int) -> tuple[str, list[ParsedCall]]:
    """`text` through a ToolCallStream, `step` characters at a time: (content, calls)."""
    stream = ToolCallStream(NAMES)
    events = []
    for i in range(0, len(text), step):
        events += stream.feed(text[i : i + step])
    events += stream.finish()
    return "".join(e for e in events if isinstance(e, str)), [e for e in events if not isinstance(e, str)]


# The block pattern the parser used before issue 24 (quadratic on openings without a closing one).
_LAZY_BLOCK = re.compile(re.escape(BEGIN) + r"(.*?)" + re.escape(END), re.DOTALL)


def test_the_one_pass_parser_finds_the_blocks_the_lazy_regex_found() -> None:
    rnd = random.Random(24)
    parts = [BEGIN, END, BEGIN[:5], END[:7], "x", " ", "\n", '{"name": "get_time", "arguments": {}}', "{"]
    for _ in range(500):
        text = "".join(rnd.choice(parts) for _ in range(rnd.randrange(12)))
        expected = [(m.start(), m.end(), m.group(1)) for m in _LAZY_BLOCK.finditer(text)]
        assert list(tool_calls.blocks(text)) == expected, text
        content, calls = parse(text, NAMES)
        for step in (1, 3, 11):
            stream_content, stream_calls = streamed(text, step)
            assert (stream_content or None, [c.name for c in stream_calls]) == (
                content or None,
                [c.name for c in calls],
            ), text


def test_unclosed_openings_cost_one_pass_like_plain_text_of_their_length() -> None:
    """8,192 openings with no closing one (a `response_format` pattern can force them): the lazy regex took
    seconds per choice, rescanning the rest of the text from each opening. Both parsers now cost about what
    plain text of the same length does, measured here; the bound is generous (regex: ~10^5 times)."""
    hostile = "Sure. " + BEGIN * 8192
    plain = "x" * len(hostile)
    assert parse(hostile, NAMES) == (hostile, []) and streamed(hostile, 4) == (hostile, [])
    ratio = best_of(5, lambda: parse(hostile, NAMES)) / best_of(5, lambda: parse(plain, NAMES))
    assert ratio < 50, ratio
    ratio = best_of(3, lambda: streamed(hostile, 4)) / best_of(3, lambda: streamed(plain, 4))
    assert ratio < 3, ratio  # the held text grew by copies and was searched from its start: ~10x


DEEP = "[" * 100_000 + "]" * 100_000  # deeper than Python's JSON decoder goes: RecursionError inside


@pytest.mark.parametrize(
    "inside",
    [
        DEEP,
        f'{{"name": "get_time", "arguments": {DEEP}}}',
        json.dumps({"name": "get_time", "arguments": DEEP}),
    ],
    ids=["block", "arguments", "arguments-as-a-string"],
)
def test_json_nested_past_the_decoder_is_a_malformed_call_that_stays_text(inside: str) -> None:
    text = f"Hm. {BEGIN}{inside}{END}"
    assert parse(text, NAMES) == (text, [])
    assert streamed(text, 1000) == (text, [])


def _output(text: str) -> RequestOutput:
    return RequestOutput(request_id="r", text=text, finished=True, finish_reason=FinishReason.STOP)


def test_a_choice_whose_call_nests_too_deep_keeps_its_text_whole_and_streamed(llama: TinySetup) -> None:
    texts = PromptBuilder(llama.model_dir).tokens
    text = f'{BEGIN}{{"name": "get_time", "arguments": {DEEP}}}{END}'
    whole = ChatRenderer("r", "m", Shape(tool_names=NAMES), [[1]], texts)
    whole.add(_output(text))
    assert whole.heavy()  # 200,000 characters: shaped and rendered off the event loop
    [choice] = whole.choices()
    assert isinstance(choice, ChatChoice)
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (text, None, "stop")
    stream = ChatRenderer("r", "m", Shape(tool_names=NAMES), [[1]], texts)
    assert stream._pieces(RequestOutput(request_id="r", text=text[:-1])) == []  # held: it may be a call
    last = _output(text[-1:])
    assert stream.heavy(last)  # what the stream held comes out now
    pieces = stream._pieces(last)
    assert "".join(p.delta.content or "" for p in pieces) == text
    assert not any(p.delta.tool_calls for p in pieces)
    assert pieces[-1].finish_reason == "stop"


def test_a_response_is_heavy_past_its_bounds_of_openings_and_characters(llama: TinySetup) -> None:
    texts = PromptBuilder(llama.model_dir).tokens

    def heavy(text: str, tool_names: frozenset[str] = NAMES) -> bool:
        choices = ChatRenderer("r", "m", Shape(tool_names=tool_names), [[1]], texts)
        choices.add(_output(text))
        return choices.heavy()

    assert not heavy("hello " + BEGIN * (HEAVY_BLOCKS - 1))
    assert heavy("hello " + BEGIN * HEAVY_BLOCKS)
    assert not heavy(BEGIN * HEAVY_BLOCKS, frozenset())  # no tools: nothing to parse
    assert not heavy("x" * (HEAVY_CHARS - 1), frozenset())
    assert heavy("x" * HEAVY_CHARS, frozenset())
    stream = ChatRenderer("r", "m", Shape(tool_names=NAMES), [[1]], texts)
    call = f'{BEGIN}{{"name": "get_time", "arguments": {{}}}}{END}'
    assert not stream.heavy(RequestOutput(request_id="r", text=call * (HEAVY_BLOCKS - 1)))
    assert stream.heavy(RequestOutput(request_id="r", text=call * HEAVY_BLOCKS))  # a piece of many calls


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


def test_a_chat_is_tokenised_as_the_template_tokenises_it(llama: TinySetup) -> None:
    """PromptBuilder.chat asks the fast tokenizer for the rendered text's ids itself: the same ids as
    `apply_chat_template(tokenize=True)`, control tokens included."""
    prompts = PromptBuilder(llama.model_dir)
    for messages in (
        [ChatMessage(role="user", content="hello " * 60)],
        [
            ChatMessage(role="system", content="Be brief. <|im_end|> é 日本 🙂"),
            ChatMessage(role="user", content="x"),
        ],
        [ChatMessage(role="user", content="Weather?")],
    ):
        for tools in (None, [dict(t) for t in TOOLS]):
            conversation = [{"role": m.role, "content": m.text()} for m in messages]
            expected = prompts.tokenizer.apply_chat_template(
                conversation,
                tools=cast(Any, tools),
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            assert prompts.chat(messages, tools) == expected


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


def test_a_forced_call_beside_a_response_format_is_the_call(account: Account) -> None:
    """The Agents SDK forces a first call on an agent with an output type, sending its response_format too:
    the turn is the call (before: a 400); the format shapes the text once tool_choice is auto again."""
    schema: dict[str, object] = {
        "type": "object",
        "properties": {"answer": {"type": "string"}},
        "required": ["answer"],
    }
    answer_format: ResponseFormatJSONSchema = {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": schema},
    }
    forced = account.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        response_format=answer_format,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert forced.choices[0].finish_reason == "tool_calls"
    assert_calls(forced.choices[0].message.tool_calls, {"get_weather"})
    answered = account.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="auto",
        response_format=answer_format,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    content = answered.choices[0].message.content
    assert content is not None and set(json.loads(content)) == {"answer"}, content


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


# A pattern forces the tiny model to write openings only, never a closing tag: as many as make the final
# body heavy (the tool parse then runs off the event loop); ~6 tokens each.
OPENINGS: ResponseFormatJSONSchema = {
    "type": "json_schema",
    "json_schema": {
        "name": "openings",
        "schema": {"type": "string", "pattern": f"^({re.escape(BEGIN)}){{{HEAVY_BLOCKS}}}$"},
    },
}


class HealthProbe:
    """Wraps a step of building a response: each call first asks the same server for /healthz, which only
    an event loop left free can answer (run on the loop, the step would block it until the probe gives up)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[int | str] = []

    def around(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def probed(*args: Any, **kwargs: Any) -> Any:
            try:
                self.answers.append(httpx.get(f"{self.url}/healthz", timeout=5).status_code)
            except httpx.TimeoutException:
                self.answers.append("no answer: the event loop was held")
            return step(*args, **kwargs)

        return probed


def test_a_response_of_many_unclosed_calls_is_parsed_off_the_event_loop(
    served: Served, account: Account, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = HealthProbe(served.url)
    monkeypatch.setattr(chat_renderer, "parse", probe.around(parse))
    reply = account.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[CLOCK], response_format=OPENINGS, max_tokens=8 * HEAVY_BLOCKS
    )
    choice = reply.choices[0]
    assert choice.message.content == json.dumps(BEGIN * HEAVY_BLOCKS)  # as written: no call in it
    assert (choice.message.tool_calls, choice.finish_reason) == (None, "stop")
    assert probe.answers == [200]


def test_a_stream_releases_a_large_held_call_off_the_event_loop(
    served: Served, account: Account, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The held text of an unclosed call comes out at the end of its choice, in one piece: past HEAVY_CHARS
    (lowered here to what the tiny engine's context can hold) that piece is built off the event loop."""
    monkeypatch.setattr(rendering, "HEAVY_CHARS", len(BEGIN) * HEAVY_BLOCKS // 2)
    probe = HealthProbe(served.url)
    monkeypatch.setattr(ToolCallStream, "finish", probe.around(ToolCallStream.finish))
    stream = account.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[CLOCK],
        response_format=OPENINGS,
        max_tokens=8 * HEAVY_BLOCKS,
        stream=True,
    )
    deltas = [c for chunk in stream for c in chunk.choices]
    assert "".join(c.delta.content or "" for c in deltas) == json.dumps(BEGIN * HEAVY_BLOCKS)
    assert not any(c.delta.tool_calls for c in deltas)
    assert deltas[-1].finish_reason == "stop"
    assert probe.answers == [200]


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    (
        "unknown-named-tool",
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
        "tool_choice",
    ),
    ("required-without-tools", {"tool_choice": "required"}, "tool_choice"),
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


@pytest.mark.parametrize("depth", [500, 50_000], ids=["past-the-template", "past-the-decoder"])
def test_a_past_calls_arguments_nested_too_deep_are_400_not_500(
    served: Served, refused: Account, depth: int
) -> None:
    call_ = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * depth + "]" * depth}}
    message = cast(ChatCompletionMessageParam, {"role": "assistant", "content": None, "tool_calls": [call_]})

    def call() -> object:
        return refused.client.chat.completions.create(
            model=MODEL, messages=[*MESSAGES, message], max_tokens=4
        )

    assert "nest too deeply" in assert_refused(served, refused, call, "messages")["message"]
