"""The Responses API's pieces without a server: items -> chat messages (calls joined to their assistant
turn, outputs as tool messages, whole turns dropped for truncation) and the event order of a stream."""

import json
from typing import Any

import pytest
from pydantic import ValidationError

from app.errors import InvalidParameter
from app.responses.conversation import Conversation, with_ids
from app.responses.output import OutputBuilder
from app.responses.request import ResponseRequest


def events(raw: list[str]) -> list[dict[str, object]]:
    out = []
    for event in raw:
        name, data = event.strip().split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        out.append(payload)
    return out


def test_text_then_a_call_are_two_items_announced_in_the_sdks_order() -> None:
    builder = OutputBuilder()
    builder.text("Let me check. ")
    builder.text("One moment.")
    builder.call_opens("call_1", "get_weather")
    builder.call_arguments('{"city": "Oslo"}')
    builder.finish()
    got = events(builder.take())
    assert [e["type"] for e in got] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert got[4]["text"] == "Let me check. One moment."
    assert [e["output_index"] for e in got] == [0] * 7 + [1] * 4
    message, call = (item.model_dump() for item in builder.items)
    assert message["content"][0]["text"] == "Let me check. One moment." and message["status"] == "completed"
    assert call["arguments"] == '{"city": "Oslo"}' and call["call_id"] == "call_1"


def test_an_output_cut_short_leaves_its_item_incomplete() -> None:
    builder = OutputBuilder()
    builder.text("half a sen")
    builder.finish("incomplete")
    assert builder.items[0].status == "incomplete"


def request(**fields: object) -> ResponseRequest:
    return ResponseRequest.model_validate({"model": "m", **fields})


class CountedDelta(str):
    """A delta that counts how often it is concatenated onto accumulated text: `text += delta` with a plain
    str on the left calls this subclass's __radd__ first, so per-delta concatenation (quadratic in the
    stream's length) is seen without timing anything."""

    joins = 0

    def __radd__(self, other: str) -> str:
        CountedDelta.joins += 1
        return str.__add__(other, str(self))


def test_a_long_stream_is_joined_once_not_per_delta() -> None:
    """Issue 35, item 8a: 131k deltas took 8.3 s when each was appended with +=; pieces are now collected
    and joined once when the item closes, text and function-call arguments alike."""
    CountedDelta.joins = 0
    pieces = [CountedDelta(f"w{i} ") for i in range(20_000)]
    builder = OutputBuilder()
    for piece in pieces:
        builder.text(piece)
    builder.call_opens("call_1", "f")
    for piece in pieces[:5_000]:
        builder.call_arguments(piece)
    builder.finish()
    got = events(builder.take())
    text = "".join(pieces)
    assert builder.items[0].content[0].text == text  # type: ignore[union-attr]
    assert builder.items[1].arguments == "".join(pieces[:5_000])  # type: ignore[union-attr]
    assert [e["text"] for e in got if e["type"] == "response.output_text.done"] == [text]
    assert sum(e["type"] == "response.output_text.delta" for e in got) == 20_000
    assert CountedDelta.joins == 0  # no delta was ever concatenated onto the text so far


def test_items_become_the_chat_conversation_with_calls_and_outputs() -> None:
    body = request(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking."}],
            },
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_2", "output": "noon"},
        ],
    )
    items = with_ids(body.items())
    assert all(item["id"].startswith(("msg_", "fc_")) for item in items)
    messages = Conversation([], items).messages(body.instructions)
    assert [m.role for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert messages[2].text() == "Checking."
    assert [c.id for c in messages[2].tool_calls or ()] == ["call_1", "call_2"]
    assert (messages[3].tool_call_id, messages[3].text()) == ("call_1", "sunny")


def turn(n: int) -> list[dict[str, Any]]:
    return [
        {"type": "message", "role": "user", "content": f"q{n}"},
        {"type": "function_call", "call_id": f"c{n}", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": f"c{n}", "output": "x"},
    ]


def test_truncation_drops_the_oldest_whole_turn() -> None:
    conversation = Conversation([*turn(1), *turn(2)], with_ids(request(input="now").items()))
    shorter = conversation.without_oldest_turn()
    assert shorter is not None and shorter.context == turn(2)
    last = shorter.without_oldest_turn()
    assert last is not None and last.context == [] and last.without_oldest_turn() is None


def test_tools_become_chat_tools_and_the_chat_checks_still_apply() -> None:
    body = request(
        input="hi", tools=[{"type": "function", "name": "f"}], tool_choice={"type": "function", "name": "f"}
    )
    chat = Conversation([], with_ids(body.items())).chat_request(body)
    assert chat.tools is not None and chat.tools[0].function.name == "f"
    assert chat.tool_choice is not None and not isinstance(chat.tool_choice, str)
    assert chat.tool_choice.function.name == "f"
    # Each schema is within its own bound; together they pass the chat path's bound on all tools.
    schema = {"type": "object", "description": "x" * 30_000}
    many = request(
        input="hi", tools=[{"type": "function", "name": f"f{n}", "parameters": schema} for n in range(5)]
    )
    with pytest.raises(InvalidParameter) as refused:
        Conversation([], with_ids(many.items())).chat_request(many)
    assert refused.value.param == "tools" and refused.value.status == 400


@pytest.mark.parametrize(
    "fields",
    [
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
        {"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": []}]},
        {"input": "hi", "background": True},
        {"input": [{"role": "user", "content": [{"type": {}, "text": ""}]}]},  # unhashable: found by fuzzing
        {"input": ""},
        {"input": "hi", "metadata": {str(n): "v" for n in range(17)}},
    ],
)
def test_what_cannot_be_served_fails_validation(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        request(**fields)


def test_vllms_extensions_reach_the_chat_request_and_are_bounded() -> None:
    extras = {"ignore_eos": True, "min_tokens": 3, "stop_token_ids": [7], "top_k": 5}
    body = request(input="hi", max_output_tokens=8, **extras)
    chat = Conversation([], with_ids(body.items())).chat_request(body)
    assert (chat.ignore_eos, chat.min_tokens, chat.stop_token_ids, chat.top_k) == (True, 3, [7], 5)
    with pytest.raises(ValidationError):
        request(input="hi", min_tokens=-1)


def test_the_fields_sdks_send_on_their_own_are_accepted_and_change_nothing() -> None:
    plain = request(input="hi")
    body = request(
        input="hi",
        include=[],  # the Agents SDK sends it on every call
        service_tier="auto",
        prompt_cache_key="k",
        top_logprobs=0,
        reasoning={"effort": None, "summary": None},
    )
    chat = Conversation([], with_ids(body.items())).chat_request(body)
    assert chat == Conversation([], with_ids(plain.items())).chat_request(plain)
    request(input="hi", include=["reasoning.encrypted_content"], reasoning={"effort": "none"})


@pytest.mark.parametrize(
    "fields",
    [
        {"include": ["message.output_text.logprobs"]},  # would be dropped silently: logprobs are not served
        {"include": ["everything"]},
        {"reasoning": {"effort": "extreme"}},  # efforts are OpenAI's (whether the model thinks: at plan time)
        {"reasoning": {"summary": "everything"}},
        {"conversation": "conv_1"},  # not served: an unknown field stays a 400
    ],
)
def test_what_sdks_may_send_but_is_not_served_fails_validation(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        request(input="hi", **fields)


def test_a_forced_call_leaves_the_text_format_for_the_turn_after_it() -> None:
    """The Agents SDK sends an agent's output type beside the tool_choice that forces its first call."""
    tools = [{"type": "function", "name": "f"}]
    fmt = {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}}
    for forced in ({"type": "function", "name": "f"}, "required"):
        body = request(input="hi", tools=tools, tool_choice=forced, text=fmt)
        assert Conversation([], with_ids(body.items())).chat_request(body).response_format is None
    after = request(input="hi", tools=tools, tool_choice="auto", text=fmt)
    assert Conversation([], with_ids(after.items())).chat_request(after).response_format is not None
