"""response_format: JSON Schema (raw, or the SDK's parse() from a Pydantic model) and json_object, on the
base model and an adapter, streamed and not. The demo model is random: only constrained decoding makes
its output valid JSON at all, let alone valid against a schema."""

import json
from typing import Any, Literal, cast

import jsonschema
import pytest
from openai.types.chat import ChatCompletionMessageParam
from openai.types.shared_params import ResponseFormatJSONSchema
from pydantic import BaseModel, Field

from app.metrics import MEMORY
from deployments.engine_metrics import EngineMetrics
from tests.app.conftest import MODEL, Served
from tests.app.features import MODELS, Account, account_with_adapter, account_without_adapter, assert_refused
from tests.app.test_observability import wait_for

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
    if reply.choices[0].finish_reason == "stop":  # a free object may run past max_tokens
        assert content is not None and isinstance(json.loads(content), dict)
    else:
        assert content is not None and content.startswith("{")


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
