"""Budget-aware closing: a structured output completes within max_tokens whenever max_tokens is at least
its grammar's `min_tokens`, and a smaller max_tokens is refused before any token.

The tiny model is random and never closes a free string by itself: without the closing every output here
would run to max_tokens and be cut, so a pass cannot be the model's doing.
"""

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from deployments.engine.grammar.compiler import CompiledGrammar
from deployments.engine.interface import (
    BudgetTooSmall,
    EngineRequest,
    FinishReason,
    SamplingParams,
    StructuredOutput,
)
from deployments.engine.llm_engine import LLMEngine
from tests.engine.helpers import drain, make_engine, preload, text, tokens
from tests.model_fixtures import TinySetup

PERSON: dict[str, Any] = {  # the issue's schema: every string free
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
NESTED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 3},
        "note": {"type": "string"},  # optional: dropped when the budget runs low
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "emails": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                "role": {"enum": ["admin", "guest"]},
            },
            "required": ["name", "emails", "role"],
        },
        "scores": {"type": "array", "items": {"type": "number", "minimum": 10}, "minItems": 2},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]+$"},
        "kind": {"anyOf": [{"type": "null"}, {"type": "string"}]},
    },
    "required": ["title", "owner", "scores", "code", "kind"],
    "additionalProperties": False,
}
CALL: dict[str, Any] = {  # what app/tool_calls.py builds for tool_choice "required" with one tool
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
SPECS: dict[str, tuple[StructuredOutput, dict[str, Any]]] = {
    "person": (StructuredOutput(json.dumps(PERSON)), PERSON),
    "nested": (StructuredOutput(json.dumps(NESTED)), NESTED),
    "object": (StructuredOutput('{"type": "object"}'), {"type": "object"}),
    "strings": (StructuredOutput('{"type": "array", "items": {"type": "string"}}'), {"type": "array"}),
    "call": (
        StructuredOutput(
            json.dumps(CALL), begin="<tool_call>", end="</tool_call>", repeat=True, param="tools"
        ),
        CALL,
    ),
}


def values(output: str, spec: StructuredOutput) -> list[Any]:
    """The JSON values of an output (one per tool-call block for a tool-call spec)."""
    if not spec.begin:
        return [json.loads(output)]
    blocks = output.split("\n")
    assert all(b.startswith(spec.begin) and b.endswith(spec.end) for b in blocks), output
    return [json.loads(b.removeprefix(spec.begin).removesuffix(spec.end)) for b in blocks]


@pytest.fixture(scope="module")
def engine(llama: TinySetup) -> Iterator[LLMEngine]:
    engine = make_engine(llama, max_num_seqs=32, num_kv_blocks=1024, max_num_batched_tokens=256)
    preload(engine, llama)
    yield engine
    engine.close()


def grammar(engine: LLMEngine, spec: StructuredOutput) -> CompiledGrammar:
    return engine.grammars.compile(spec)


@pytest.mark.parametrize("name", list(SPECS))
def test_the_opening_closing_is_the_shortest_valid_output(engine: LLMEngine, name: str) -> None:
    spec, schema = SPECS[name]
    compiled = grammar(engine, spec)
    assert compiled.min_tokens is not None
    matcher = compiled.matcher()
    closing = matcher._plan  # the tokens the grammar would steer through from the start
    assert closing is not None and len(closing) + 1 == compiled.min_tokens
    output = str(engine.tokenizer.decode(closing))
    for value in values(output, spec):
        jsonschema.validate(value, schema)
    expected = {
        "person": '{"name":"","age":0,"tags":[]}',
        "object": "{}",
        "strings": "[]",
        "call": '<tool_call>{"name":"get_weather","arguments":{"city":""}}</tool_call>',
    }
    if name in expected:
        assert output == expected[name]
    else:  # the optional note is left out, bounds are met with the fewest characters
        assert json.loads(output) == {
            "title": "aaa",
            "owner": {"name": "", "emails": [""], "role": "admin"},
            "scores": [10, 10],
            "code": "AA0",
            "kind": "",
        }


def test_a_budget_below_the_minimum_is_refused_before_any_token(engine: LLMEngine) -> None:
    spec = SPECS["person"][0]
    minimum = grammar(engine, spec).min_tokens
    assert minimum is not None
    before = engine.generated_tokens
    params = SamplingParams(max_tokens=minimum - 1, structured=spec, n=2)
    with pytest.raises(BudgetTooSmall) as refused:
        engine.add_request(EngineRequest("short", [5, 6, 7], params))
    assert refused.value.param == "max_tokens" and refused.value.minimum == minimum
    assert f"at least {minimum} tokens" in str(refused.value)
    assert not engine.has_unfinished() and engine.generated_tokens == before


def run(engine: LLMEngine, requests: dict[str, SamplingParams], llama: TinySetup) -> dict[str, Any]:
    adapters = [None, *llama.refs.values()]
    for i, (rid, params) in enumerate(requests.items()):
        engine.add_request(EngineRequest(rid, [5 + i, 6, 7, 8], params, adapters[i % len(adapters)]))
    return drain(engine)


@pytest.mark.parametrize("name", list(SPECS))
def test_every_budget_from_the_minimum_up_completes_and_validates(
    engine: LLMEngine, llama: TinySetup, name: str
) -> None:
    spec, schema = SPECS[name]
    minimum = grammar(engine, spec).min_tokens
    assert minimum is not None
    budgets = [minimum, minimum + 1, minimum + 2, minimum + 5, minimum + 17, 120]
    requests = {
        f"{name}-{budget}-{seed}": SamplingParams(
            max_tokens=budget, temperature=1.0, seed=seed, n=2 if seed else 1, structured=spec
        )
        for budget in budgets
        for seed in (0, 1)
    }
    outputs = run(engine, requests, llama)
    steered = 0
    for rid, params in requests.items():
        for index in range(params.n):
            outs = [o for o in outputs[rid] if o.index == index]
            last = outs[-1]
            assert last.finish_reason is FinishReason.STOP, (rid, text(outs))
            assert len(tokens(outs)) <= (params.max_tokens or 0)
            for value in values(text(outs), spec):
                jsonschema.validate(value, schema)
            steered += last.closing_forced
    assert steered > 0  # the random model never closes a free string: the budget did


def test_stop_strings_and_stop_tokens_never_cut_a_structured_output(
    engine: LLMEngine, llama: TinySetup
) -> None:
    spec, schema = SPECS["person"]
    quote = int(engine.tokenizer.convert_tokens_to_ids('"'))  # type: ignore[arg-type]
    params = SamplingParams(
        max_tokens=40, temperature=1.0, seed=3, stop=('"', ","), stop_token_ids=(quote,), structured=spec
    )
    outputs = run(engine, {"stops": params}, llama)["stops"]
    assert outputs[-1].finish_reason is FinishReason.STOP and outputs[-1].stop_reason is None
    jsonschema.validate(json.loads(text(outputs)), schema)


def test_a_steered_token_reports_its_own_logprob(engine: LLMEngine, llama: TinySetup) -> None:
    spec = SPECS["nested"][0]
    minimum = grammar(engine, spec).min_tokens
    assert minimum is not None
    params = SamplingParams(max_tokens=minimum + 3, temperature=1.0, seed=5, logprobs=2, structured=spec)
    outputs = run(engine, {"lp": params}, llama)["lp"]
    assert outputs[-1].closing_forced
    reported = [lp.token_id for out in outputs for lp in out.logprobs or []]
    assert reported == tokens(outputs)


def test_unconstrained_rows_beside_steered_ones_decode_as_alone(engine: LLMEngine, llama: TinySetup) -> None:
    free = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    spec = SPECS["person"][0]
    minimum = grammar(engine, spec).min_tokens
    assert minimum is not None
    closing = SamplingParams(max_tokens=minimum + 2, temperature=0.9, seed=7, structured=spec, n=3)
    outputs = run(engine, {"free": free, "closing": closing}, llama)
    alone = run(engine, {"free-alone": free}, llama)
    assert tokens(outputs["free"]) == tokens(alone["free-alone"])
