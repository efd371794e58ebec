"""Triggered grammars (tool_choice "auto"): free text is left alone, and a call, once its opening is written,
is a whole call of a listed tool that completes within max_tokens (or is not begun at all).

The tiny model is random: it never writes `<tool_call>` by itself, nor closes a string. `spelled` makes it
write the opening at once, greedily: each of the opening's tokens gets a logit bias below the previous
one's (by more than the model's own logits differ), and the repetition, presence and frequency penalties
push every token written far below the next one. Inside the call, the biased tokens (allowed in a JSON
string) and then the model's noise keep the string open: the closing ends it.
"""

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from deployments.engine.grammar.closing import Trigger
from deployments.engine.grammar.compiler import GrammarMatcher
from deployments.engine.interface import EngineRequest, FinishReason, SamplingParams, StructuredOutput
from deployments.engine.llm_engine import LLMEngine
from tests.engine.helpers import drain, make_engine, preload, text, tokens
from tests.model_fixtures import TinySetup

BEGIN, END = "<tool_call>", "</tool_call>"
ARGUMENTS: dict[str, dict[str, Any]] = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "get_time": {"type": "object", "properties": {}, "additionalProperties": False},
}
CALLS = {  # what app/completions/tool_calls.py builds for two tools
    "anyOf": [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": schema},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, schema in ARGUMENTS.items()
    ]
}


def auto(parallel: bool = True) -> StructuredOutput:
    return StructuredOutput(
        json.dumps(CALLS), begin=BEGIN, end=END, repeat=parallel, triggered=True, param="tools"
    )


@pytest.fixture(scope="module")
def engine(llama: TinySetup) -> Iterator[LLMEngine]:
    engine = make_engine(llama, max_num_seqs=32, num_kv_blocks=2048, max_num_batched_tokens=256)
    preload(engine, llama)
    yield engine
    engine.close()


def spelled(engine: LLMEngine, before: str = "") -> dict[str, Any]:
    """Sampling arguments under which the random model writes `before`'s tokens, then the opening."""
    ids = engine.tokenizer.encode(before + BEGIN, add_special_tokens=False)
    assert len(set(ids)) == len(ids)  # each written once: the penalties order them
    bias = tuple(sorted((token, 100.0 - 5.0 * i) for i, token in enumerate(ids)))
    penalties = {"repetition_penalty": 10.0, "presence_penalty": 2.0, "frequency_penalty": 2.0}
    return {"temperature": 0.0, "logit_bias": bias, **penalties}


def run(engine: LLMEngine, requests: dict[str, SamplingParams], llama: TinySetup) -> dict[str, Any]:
    adapters = [None, *llama.refs.values()]
    for i, (rid, params) in enumerate(requests.items()):
        engine.add_request(EngineRequest(rid, [5 + i, 6, 7, 8], params, adapters[i % len(adapters)]))
    return drain(engine)


def calls(output: str) -> tuple[str, list[dict[str, Any]]]:
    """(text before the first call, the calls) of an output: each call validated against its tool."""
    head, found, rest = output.partition(BEGIN)
    if not found:
        return head, []
    blocks = (BEGIN + rest).split("\n")
    values = []
    for block in blocks:
        assert block.startswith(BEGIN) and block.endswith(END), output
        value = json.loads(block.removeprefix(BEGIN).removesuffix(END))
        jsonschema.validate(value["arguments"], ARGUMENTS[value["name"]])
        values.append(value)
    return head, values


def block_budget(engine: LLMEngine) -> int:
    """The fewest tokens a begun call needs after its opening, the stop token included."""
    matcher = engine.grammars.compile(auto()).matcher()
    assert matcher._block is not None
    return len(matcher._block) + 1


def test_free_text_decodes_as_unconstrained_and_ends_by_length(engine: LLMEngine, llama: TinySetup) -> None:
    plain = run(engine, {"plain": SamplingParams(max_tokens=24, temperature=0)}, llama)["plain"]
    params = SamplingParams(max_tokens=24, temperature=0, structured=auto())
    free = run(engine, {"auto": params}, llama)["auto"]
    assert tokens(free) == tokens(plain)
    assert free[-1].finish_reason is FinishReason.LENGTH and not free[-1].closing_forced
    assert BEGIN not in text(free)


@pytest.mark.parametrize("parallel", [True, False])
def test_a_begun_call_completes_at_every_budget(engine: LLMEngine, llama: TinySetup, parallel: bool) -> None:
    opening = len(engine.tokenizer.encode("Hi" + BEGIN, add_special_tokens=False))
    smallest = opening + block_budget(engine)
    budgets = [smallest, smallest + 1, smallest + 7, 100, 400, 1000]
    requests = {
        f"call-{budget}": SamplingParams(
            max_tokens=budget, n=2, structured=auto(parallel), **spelled(engine, "Hi")
        )
        for budget in budgets
    }
    outputs = run(engine, requests, llama)
    for rid, params in requests.items():
        for index in range(params.n):
            outs = [o for o in outputs[rid] if o.index == index]
            last = outs[-1]
            assert last.finish_reason is FinishReason.STOP, (rid, text(outs))
            assert len(tokens(outs)) <= (params.max_tokens or 0)
            head, found = calls(text(outs))
            assert head == "Hi" and found, (rid, text(outs))
            assert parallel or len(found) == 1
    # Most calls have a free string the model never closes: the budget closed them.
    assert any(outputs[rid][-1].closing_forced for rid in requests)


def test_a_call_that_could_not_complete_is_not_begun(engine: LLMEngine, llama: TinySetup) -> None:
    opening = len(engine.tokenizer.encode(BEGIN, add_special_tokens=False))
    budget = opening + block_budget(engine) - 1
    params = SamplingParams(max_tokens=budget, structured=auto(), **spelled(engine))
    outputs = run(engine, {"short": params}, llama)["short"]
    assert outputs[-1].finish_reason is FinishReason.STOP and outputs[-1].closing_forced
    assert text(outputs) == BEGIN[: -len(">")]  # the text up to the token that would have opened it
    assert len(tokens(outputs)) == opening  # that token's place went to the stop token


def test_stop_strings_end_free_text_but_never_cut_a_call(engine: LLMEngine, llama: TinySetup) -> None:
    in_text = SamplingParams(max_tokens=60, stop=("_c",), structured=auto(), **spelled(engine))
    in_call = SamplingParams(max_tokens=60, stop=('"', "name"), structured=auto(), **spelled(engine))
    outputs = run(engine, {"in-text": in_text, "in-call": in_call}, llama)
    stopped = outputs["in-text"][-1]
    assert (stopped.finish_reason, stopped.stop_reason) == (FinishReason.STOP, "_c")
    assert text(outputs["in-text"]) == "<tool"
    whole = outputs["in-call"][-1]
    assert whole.finish_reason is FinishReason.STOP and whole.stop_reason is None
    assert calls(text(outputs["in-call"]))[1]


def test_the_trigger_finds_an_opening_split_across_tokens() -> None:
    trigger = Trigger(BEGIN.encode())
    found: list[bytes | None] = []
    for piece in [b'say "', b"<to", b"ol_c", b"all>{", b'"name"']:
        trigger, rest = trigger.after(piece)
        found.append(rest)
        if rest is not None:
            break
    assert found == [None, None, None, b"{"]


def test_text_after_a_call_and_a_second_call_without_parallel_are_refused(engine: LLMEngine) -> None:
    call = BEGIN + '{"name":"get_time","arguments":{}}' + END

    def writes(spec: StructuredOutput, output: str) -> bool:
        matcher: GrammarMatcher = engine.grammars.compile(spec).matcher()
        ids = engine.tokenizer.encode(output, add_special_tokens=False)
        return all(matcher.accept(t) for t in ids)

    assert writes(auto(), 'He said "hi" ' + call + "\n" + call)
    assert not writes(auto(parallel=False), call + "\n" + call)
    assert not writes(auto(), call + " and more")
    assert not writes(auto(), BEGIN + "not JSON")
    assert engine.grammars.compile(auto()).min_tokens == 1  # free text may end at once: never refused
