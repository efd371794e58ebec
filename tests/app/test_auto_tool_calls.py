"""tool_choice "auto" through the API with the OpenAI SDK: the model may answer in text, and a call it has
begun comes back whole (finish_reason "tool_calls", arguments that validate), at every max_tokens, streamed
or not, for every choice; never a half call.

The tiny model is random and never writes `<tool_call>` by itself: `spelled` makes it write the opening
first (a falling logit bias on the opening's tokens, and penalties that push each token written below the
next; see tests/engine/test_auto_tool_calls.py). The prompt holds the opening too (the template's tool
instructions), so the repetition penalty divides the biases from the start: their steps are a tenth, and
only greedy or a low temperature writes them in order. The note's text is then free text the model never
closes: only the budget's closing ends it.
"""

import json
from dataclasses import dataclass
from functools import partial
from typing import Any

import jsonschema
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from app.completions.tool_calls import BEGIN
from app.served_models.prompts import PromptBuilder
from tests.app.conftest import MODEL, Served
from tests.app.features import Account, account_with_adapter, account_without_adapter, assert_refused
from tests.app.test_tool_calls import CLOCK
from tests.app.test_tool_calls import SCHEMAS as CALL_SCHEMAS

NOTE: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "take_note",
        "description": "Write a note down.",
        "parameters": {
            "type": "object",
            "properties": {
                "text": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["text"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [NOTE, CLOCK]
SCHEMAS = {"take_note": NOTE["function"]["parameters"], "get_time": CALL_SCHEMAS["get_time"]}
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Note that the bridge is red."}]


@pytest.fixture(scope="module")
def account(served: Served) -> Account:
    return account_with_adapter(served, "auto-tools")


@pytest.fixture(scope="module")
def spelled(served: Served) -> dict[str, Any]:
    """Request fields under which the random model writes the call's opening first."""
    ids = PromptBuilder(served.setup.model_dir).tokenizer.encode(BEGIN, add_special_tokens=False)
    assert len(set(ids)) == len(ids)
    return {
        "logit_bias": {str(token): 100 - 5 * i for i, token in enumerate(ids)},
        "presence_penalty": 2.0,
        "frequency_penalty": 2.0,
        "extra_body": {"repetition_penalty": 10.0},
    }


@dataclass
class Choice:
    """One choice of a reply, whole or put together from its stream's deltas."""

    content: str | None
    calls: list[tuple[str, str]]  # (name, arguments)
    finish_reason: str | None
    forced: bool


def ask(account: Account, spelled: dict[str, Any], stream: bool, **body: Any) -> list[Choice]:
    request = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, **spelled} | body
    if not stream:
        reply = account.client.chat.completions.create(**request)
        return [
            Choice(
                c.message.content,
                [
                    (t.function.name, t.function.arguments)
                    for t in c.message.tool_calls or []
                    if t.type == "function"
                ],
                c.finish_reason,
                (c.model_extra or {}).get("closing_forced") is True,
            )
            for c in reply.choices
        ]
    parts: dict[int, dict[str, Any]] = {}
    for chunk in account.client.chat.completions.create(**request, stream=True):
        for c in chunk.choices:
            part = parts.setdefault(c.index, {"content": [], "calls": {}, "finish": None, "forced": False})
            part["content"].append(c.delta.content or "")
            for t in c.delta.tool_calls or []:
                name, arguments = part["calls"].get(t.index, ("", ""))
                function = t.function
                if function is not None:
                    name, arguments = name + (function.name or ""), arguments + (function.arguments or "")
                part["calls"][t.index] = (name, arguments)
            part["finish"] = c.finish_reason or part["finish"]
            part["forced"] |= (c.model_extra or {}).get("closing_forced") is True
    return [
        Choice("".join(p["content"]) or None, list(p["calls"].values()), p["finish"], p["forced"])
        for _, p in sorted(parts.items())
    ]


def whole_or_text(choices: list[Choice]) -> tuple[int, int]:
    """Each choice is whole calls (finish_reason "tool_calls", arguments valid for their tool) or text with
    no opening in it; (choices with calls, choices whose closing was forced)."""
    with_calls = forced = 0
    for choice in choices:
        forced += choice.forced
        assert BEGIN not in (choice.content or ""), choice  # a begun call is never left as text
        if not choice.calls:
            assert choice.finish_reason in ("stop", "length"), choice
            continue
        with_calls += 1
        assert choice.finish_reason == "tool_calls", choice
        for name, arguments in choice.calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    return with_calls, forced


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_begun_call_always_completes(account: Account, spelled: dict[str, Any], stream: bool) -> None:
    with_calls = forced = 0
    for budget in (40, 100, 400, 500):  # 500: all the tiny model's context leaves after the prompt
        for temperature in (0.0, 0.1):
            choices = ask(
                account,
                spelled,
                stream,
                tools=[NOTE],
                max_tokens=budget,
                n=3,
                temperature=temperature,
                seed=budget,
            )
            assert len(choices) == 3
            calls, closed = whole_or_text(choices)
            with_calls, forced = with_calls + calls, forced + closed
            if temperature == 0 and budget >= 100:  # greedy writes the opening; 40 leaves no room for
                assert calls == 3, choices  # the call after it (the text ends before it instead)
    assert forced > 0  # the random model never closes its note's text: the budget did


def test_a_call_with_no_room_to_complete_is_not_begun(account: Account, spelled: dict[str, Any]) -> None:
    for stream in (False, True):
        [choice] = ask(account, spelled, stream, max_tokens=8, temperature=0.0)
        assert (choice.calls, choice.finish_reason, choice.forced) == ([], "stop", True)
        assert choice.content == BEGIN[: -len(">")]  # the text before the token that would open it


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_without_parallel_calls_one_call_ends_the_turn(
    account: Account, spelled: dict[str, Any], stream: bool
) -> None:
    choices = ask(
        account, spelled, stream, max_tokens=300, n=3, temperature=0.1, seed=9, parallel_tool_calls=False
    )
    assert whole_or_text(choices)[0] > 0
    assert all(len(c.calls) <= 1 for c in choices)


def test_min_tokens_and_ignore_eos_are_refused_with_auto_tools(served: Served) -> None:
    refused = account_without_adapter(served, "auto-tools-refused")
    for field, value in (("min_tokens", 4), ("ignore_eos", True)):
        extra = {field: value}
        create = partial(
            refused.client.chat.completions.create,
            model=MODEL,
            messages=MESSAGES,
            tools=TOOLS,
            max_tokens=16,
            extra_body=extra,
        )
        assert_refused(served, refused, create, field)
