"""The closing's host work is bounded per request: no request's structured output stalls its neighbours.

The issue's stalling schema (an integer or a string with pattern `^[B-G]*~$`, a logit_bias that opens the
string) walked 4,096 bytes per alternative at every token on the loop thread (0.4 s a token). These tests
count the work (walk steps, walks), never time it.
"""

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from deployments.engine.grammar import closing as closing_module
from deployments.engine.grammar import compiler as compiler_module
from deployments.engine.grammar.compiler import STEP_WALK_REFILL, GrammarMatcher
from deployments.engine.interface import EngineRequest, FinishReason, SamplingParams, StructuredOutput
from deployments.engine.llm_engine import LLMEngine
from tests.engine.helpers import drain, make_engine, text, tokens
from tests.model_fixtures import TinySetup

STALLING: dict[str, Any] = {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": "^[B-G]*~$"}]}
CYCLE: dict[str, Any] = {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": "^(ab)*c$"}]}
# Its string's closing needs more bytes than a walk may follow: no closing is ever found inside it.
UNCLOSABLE: dict[str, Any] = {"anyOf": [{"type": "integer"}, {"type": "string", "minLength": 5000}]}


@pytest.fixture(scope="module")
def engine(llama: TinySetup) -> Iterator[LLMEngine]:
    engine = make_engine(llama, max_num_seqs=8, num_kv_blocks=512)
    yield engine
    engine.close()


def matcher(engine: LLMEngine, schema: dict[str, Any]) -> GrammarMatcher:
    return engine.grammars.compile(StructuredOutput(json.dumps(schema))).matcher()


def ids(engine: LLMEngine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text, add_special_tokens=False))


class WalkSpy:
    """Counts the closings walked (Closer.closing calls) and the walk steps taken (Fuel.take) meanwhile."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.walks = self.steps = 0
        closing, take = closing_module.Closer.closing, closing_module.Fuel.take

        def counted_closing(closer: closing_module.Closer, *args: Any, **kwargs: Any) -> list[int] | None:
            self.walks += 1
            return closing(closer, *args, **kwargs)

        def counted_take(fuel: closing_module.Fuel) -> bool:
            self.steps += 1
            return take(fuel)

        monkeypatch.setattr(closing_module.Closer, "closing", counted_closing)
        monkeypatch.setattr(closing_module.Fuel, "take", counted_take)


@pytest.mark.parametrize(
    ("schema", "written"), [(STALLING, '"BCBCBCBCDDDDDEEFBCBCBC'), (CYCLE, '"ababababababab')]
)
def test_a_pattern_the_order_cannot_end_closes_in_a_few_bytes(
    engine: LLMEngine, schema: dict[str, Any], written: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = matcher(engine, schema)
    spy = WalkSpy(monkeypatch)
    tokens_in = ids(engine, written)
    for token in tokens_in:
        assert m.take(token, 100) == token
        assert m.closing_tokens is not None and m.closing_tokens <= 16  # known, short, at every token
    # Before: 4,096 steps per alternative, seven walks per token. Now a few walks in all.
    assert spy.walks <= 3 and spy.steps < 200, (spy.walks, spy.steps)
    # And the closing is a real one: following it completes a value of the schema.
    plan = list(m._plan or [])
    for token in plan:
        assert m.take(token, len(plan) + 1) == token
    assert m.completed
    jsonschema.validate(json.loads(written + str(engine.tokenizer.decode(plan))), schema)


def test_a_walk_that_finds_no_closing_is_not_redone_at_every_token(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = matcher(engine, UNCLOSABLE)
    spy = WalkSpy(monkeypatch)
    opening, letter = ids(engine, '"'), ids(engine, "a")
    taken = [m.take(t, 1000) for t in [*opening, *letter * 60]]
    assert taken == [*opening, *letter * 60]  # nothing steered: no closing known to steer by
    assert m.closing_tokens is None
    # One walk, then after the k-th failure 2^k - 1 tokens without one; a walk that runs dry ends them.
    assert 1 <= spy.walks <= 6, spy.walks


def test_walks_never_cost_more_than_the_fuel_and_a_dry_walk_ends_the_steering(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compiler_module, "STEP_WALK_FUEL", 300)  # below one failed walk (4,096 bytes)
    m = matcher(engine, UNCLOSABLE)
    spy = WalkSpy(monkeypatch)
    stream = [*ids(engine, '"'), *ids(engine, "a") * 200]
    assert [m.take(t, 1000) for t in stream] == stream
    assert spy.walks == 1 and spy.steps <= 300 + 2 * STEP_WALK_REFILL  # one walk, cut by the fuel; no more
    assert m._closer is None and m.forced_token(1) is None  # steered no more: the request may end by length


def test_the_stalling_request_completes_valid_beside_a_neighbour(engine: LLMEngine, llama: TinySetup) -> None:
    spec = StructuredOutput(json.dumps(STALLING))
    quote, letter = ids(engine, '"')[0], ids(engine, "B")[0]
    constrained = SamplingParams(
        max_tokens=40, temperature=0.0, logit_bias=((quote, 100.0), (letter, 60.0)), structured=spec
    )
    neighbour = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest("alone", [5, 6, 7], neighbour))
    alone = drain(engine)["alone"]
    engine.add_request(EngineRequest("stall", [9, 10, 11], constrained))
    engine.add_request(EngineRequest("beside", [5, 6, 7], neighbour))
    outputs = drain(engine)
    value = json.loads(text(outputs["stall"]))
    jsonschema.validate(value, STALLING)
    assert isinstance(value, str) and value.startswith(
        "B"
    )  # the bias opened the string; the closing ended it
    assert outputs["stall"][-1].finish_reason is FinishReason.STOP
    assert tokens(outputs["beside"]) == tokens(alone)
