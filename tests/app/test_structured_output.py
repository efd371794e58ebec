"""response_format: JSON Schema (raw, or the SDK's parse() from a Pydantic model) and json_object, on the
base model and an adapter, streamed and not. The demo model is random: only constrained decoding makes
its output valid JSON at all, let alone valid against a schema."""

import json
import re
from typing import Any, Literal, cast

import jsonschema
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from openai.types.shared_params import ResponseFormatJSONSchema
from pydantic import BaseModel, Field

from app.metrics import MEMORY
from deployments.engine_metrics import EngineMetrics
from tests.app.conftest import MODEL, Served
from tests.app.features import MODELS, Account, account_with_adapter, account_without_adapter, assert_refused
from tests.app.helpers import wait_for

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Describe a pet as JSON."}]
MAX_TOKENS = 96
# Bounded everywhere (enums, short strings, short arrays), so a random model finishes well within MAX_TOKENS.
PET_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "kind": {"type": "string", "enum": ["cat", "dog", "fish"]},
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "vaccinated": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "owner": {
            "anyOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
                    "required": ["age"],
                    "additionalProperties": False,
                },
            ]
        },
    },
    "required": ["kind", "name", "vaccinated", "tags", "owner"],
    "additionalProperties": False,
}


def json_schema_format(schema: dict[str, Any]) -> ResponseFormatJSONSchema:
    return {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    name: str = Field(min_length=1, max_length=6)
    vaccinated: bool


@pytest.fixture(scope="module")
def account(served: Served) -> Account:
    return account_with_adapter(served, "structured")


@pytest.mark.parametrize("model", MODELS)
def test_a_json_schema_is_followed(account: Account, model: str) -> None:
    for seed in (1, 2):
        reply = account.client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            seed=seed,
            response_format=json_schema_format(PET_SCHEMA),
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        assert choice.message.content is not None
        jsonschema.validate(json.loads(choice.message.content), PET_SCHEMA)


@pytest.mark.parametrize("model", MODELS)
def test_the_sdks_parse_returns_the_pydantic_object(account: Account, model: str) -> None:
    reply = account.client.chat.completions.parse(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, response_format=Pet, seed=3
    )
    pet = reply.choices[0].message.parsed
    assert isinstance(pet, Pet)
    assert 1 <= len(pet.name) <= 6


def test_a_streamed_json_schema_is_followed_too(account: Account) -> None:
    with account.client.chat.completions.stream(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, response_format=Pet, seed=4
    ) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Pet)
    raw = "".join(
        c.choices[0].delta.content or ""
        for c in account.client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            seed=5,
            stream=True,
            response_format=json_schema_format(PET_SCHEMA),
        )
        if c.choices
    )
    jsonschema.validate(json.loads(raw), PET_SCHEMA)


@pytest.mark.parametrize("model", MODELS)
def test_json_object_returns_a_json_object(account: Account, model: str) -> None:
    reply = account.client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_object"},
    )
    content = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"  # a free object is closed in time
    assert content is not None and isinstance(json.loads(content), dict)


def test_n_choices_each_follow_the_schema(account: Account) -> None:
    reply = account.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        n=3,
        seed=9,
        response_format=json_schema_format(PET_SCHEMA),
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice in reply.choices:
        assert choice.message.content is not None
        jsonschema.validate(json.loads(choice.message.content), PET_SCHEMA)


def test_response_format_text_is_plain_text(account: Account) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    plain = account.client.chat.completions.create(**kwargs)
    text = account.client.chat.completions.create(**kwargs, response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content


@pytest.fixture(scope="module")
def refused(served: Served) -> Account:
    return account_without_adapter(served, "structured-refused")


REFUSED: list[tuple[str, Any, str]] = [
    ("bad-type", {"type": "yaml"}, "response_format"),
    (
        "schema-without-name",
        {"type": "json_schema", "json_schema": {"schema": PET_SCHEMA}},
        "response_format",
    ),
    (
        "bad-name",
        {"type": "json_schema", "json_schema": {"name": "a b", "schema": PET_SCHEMA}},
        "response_format",
    ),
    (
        "schema-too-large",
        {"type": "json_schema", "json_schema": {"name": "big", "schema": {"enum": ["x" * 40_000]}}},
        "response_format",
    ),
    ("not-a-schema", json_schema_format({"type": "nonsense"}), "response_format"),
    ("bad-ref", json_schema_format({"$ref": "#/$defs/missing"}), "response_format"),
]


@pytest.mark.parametrize(("response_format", "param"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_bad_response_formats_are_400_naming_it(
    served: Served, refused: Account, response_format: dict[str, Any], param: str
) -> None:
    def call() -> object:
        return refused.client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4,
            response_format=cast(Any, response_format),  # deliberately malformed
        )

    assert_refused(served, refused, call, param)


def test_a_schema_the_grammar_would_fail_at_its_first_token_is_a_400_naming_its_field(
    served: Served, refused: Account
) -> None:
    # 499 optional properties: the grammar library fails such an object at its "{", mid-generation; the
    # engine refuses it when compiling, and counts the refusal. (As tools, the same schema is refused
    # under `tools`, tests/engine/test_grammar.py; here its text would not fit the demo model's context.)
    wide: dict[str, Any] = {
        "type": "object",
        "properties": {f"p{i}": {"type": "integer"} for i in range(499)},
    }
    metrics = EngineMetrics(served.engine, base_model=MODEL)
    metrics.export_once()
    before = MEMORY.value("loraplex_engine_grammar_refusals", base_model=MODEL, reason="schema")

    def call() -> object:
        return refused.client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, response_format=json_schema_format(wide)
        )

    error = assert_refused(served, refused, call, "response_format")
    assert error["param"] == "response_format" and error["code"] is None
    assert "first 499 properties are optional; at most 498" in error["message"], error

    def counted() -> bool:
        metrics.export_once()
        return (
            MEMORY.value("loraplex_engine_grammar_refusals", base_model=MODEL, reason="schema") == before + 1
        )

    wait_for(counted)


# -- within max_tokens: the budget-aware closing ---------------------------------------------------------
# Free strings (which the random model never closes by itself), arrays of them, nested and optional members,
# tool calls with string arguments, streamed and not, chat and completions, n > 1: every output at a
# max_tokens from the schema's minimum up parses and validates, and parse() never raises; below the minimum
# the request is a 400 naming max_tokens and the minimum, before any token (no usage row).


class Person(BaseModel):  # the issue's model: every string free
    name: str
    age: int
    tags: list[str]


class Address(BaseModel):
    city: str
    lines: list[str]


class Contact(BaseModel):
    person: Person
    address: Address
    note: str | None = None


NESTED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "summary": {"type": "string"},  # optional
        "people": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "role": {"enum": ["lead", "member"]}},
                "required": ["name", "role"],
            },
        },
    },
    "required": ["title", "people"],
}
WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def schema_format(schema: dict[str, Any]) -> ResponseFormatJSONSchema:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}


def minimum_of(served: Served, refused: Account, **body: Any) -> int:
    """The request's minimum max_tokens, as its 400 at max_tokens 1 names it (no usage row left)."""

    def call() -> object:
        return refused.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, **body)

    error = assert_refused(served, refused, call, "max_tokens")
    assert error["code"] == "max_tokens_too_small", error
    found = re.search(
        r"max_tokens is 1, but this response format needs at least (\d+) tokens", error["message"]
    )
    assert found is not None, error
    return int(found[1])


def test_below_the_minimum_is_a_400_naming_max_tokens_and_the_minimum(
    served: Served, refused: Account
) -> None:
    minimum = minimum_of(served, refused, response_format=schema_format(_strict(Person)))
    assert 10 < minimum < 100

    def just_below() -> object:  # the SDK's parse() sends the same schema
        return refused.client.chat.completions.parse(
            model=MODEL, messages=MESSAGES, max_tokens=minimum - 1, response_format=Person, n=2
        )

    error = assert_refused(served, refused, just_below, "max_tokens")
    assert f"at least {minimum} tokens" in error["message"]


@pytest.mark.parametrize("model", MODELS)
def test_parse_never_raises_from_the_minimum_up(
    served: Served, refused: Account, account: Account, model: str
) -> None:
    for kind in (Person, Contact):
        minimum = minimum_of(served, refused, response_format=schema_format(_strict(kind)))
        for offset, seed in ((0, 1), (1, 2), (3, 3), (11, 4), (200 - minimum, 5)):
            reply = account.client.chat.completions.parse(
                model=model,
                messages=MESSAGES,
                max_tokens=minimum + offset,
                response_format=kind,
                seed=seed,
                temperature=1.0,
            )
            choice = reply.choices[0]
            assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, kind), choice
            assert reply.usage is not None and reply.usage.completion_tokens <= minimum + offset
            if offset == 0:  # the closing ran from the first token, and the choice says so
                assert (choice.model_extra or {}).get("closing_forced") is True, choice


def _strict(kind: type[BaseModel]) -> dict[str, Any]:
    """The schema the SDK's parse() sends for `kind` (strict: every property required, no others)."""
    from openai.lib._pydantic import to_strict_json_schema

    return to_strict_json_schema(kind)


def test_nested_arrays_and_optional_members_with_n_choices_and_stop_strings(
    served: Served, refused: Account, account: Account
) -> None:
    minimum = minimum_of(served, refused, response_format=schema_format(NESTED))
    for budget in (minimum, minimum + 2, minimum + 9):
        reply = account.client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=budget,
            n=3,
            seed=budget,
            stop=['"', ","],  # never applied inside a structured output
            response_format=schema_format(NESTED),
        )
        assert len(reply.choices) == 3
        for choice in reply.choices:
            assert choice.finish_reason == "stop", choice
            assert choice.message.content is not None
            jsonschema.validate(json.loads(choice.message.content), NESTED)


def test_a_streamed_output_completes_and_its_last_chunk_says_closing_was_forced(
    served: Served, refused: Account, account: Account
) -> None:
    minimum = minimum_of(served, refused, response_format=schema_format(_strict(Person)))
    with account.client.chat.completions.stream(
        model=MODEL, messages=MESSAGES, max_tokens=minimum, response_format=Person, seed=6
    ) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Person)
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None][-1]
    assert last.choices[0].finish_reason == "stop"
    assert (last.choices[0].model_extra or {}).get("closing_forced") is True


def test_json_object_always_completes(served: Served, refused: Account, account: Account) -> None:
    minimum = minimum_of(served, refused, response_format={"type": "json_object"})
    for budget in (minimum, 7, 100):
        reply = account.client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=budget,
            seed=budget,
            response_format={"type": "json_object"},
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is not None
        assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_tool_calls_with_string_arguments_complete(
    served: Served, refused: Account, account: Account, tool_choice: str
) -> None:
    choice_param: Any = (
        "required" if tool_choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    )
    minimum = minimum_of(served, refused, tools=[WEATHER], tool_choice=choice_param)
    for budget, stream in ((minimum, False), (100, False), (400, True), (600, False)):
        body: dict[str, Any] = dict(
            model=MODEL,
            messages=MESSAGES,
            tools=[WEATHER],
            tool_choice=choice_param,
            max_tokens=budget,
            seed=budget,
        )
        if stream:
            with account.client.chat.completions.stream(**body) as events:
                final = events.get_final_completion()
        else:
            final = account.client.chat.completions.create(**body)
        choice = final.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls or []
        assert calls and all(c.function.name == "get_weather" for c in calls)
        for call in calls:
            assert isinstance(json.loads(call.function.arguments)["city"], str)


def test_completions_take_a_response_format_too(served: Served, account: Account) -> None:
    for budget in (60, 200):
        reply = account.client.completions.create(
            model=MODEL,
            prompt="A person:",
            max_tokens=budget,
            seed=budget,
            extra_body={"response_format": schema_format(_strict(Person))},
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        Person.model_validate_json(choice.text)
