"""Structured output inside the engine: a grammar mask per row of the same mixed-adapter batch.

The demo model is random: only the mask makes its output valid JSON, so a pass here cannot be luck.
"""

import asyncio
import json
import threading
import time

import jsonschema
import pytest

from deployments.engine.async_engine import AsyncEngine
from deployments.engine.grammar.compiler import CompiledGrammar
from deployments.engine.interface import (
    EngineOverloaded,
    EngineRequest,
    FinishReason,
    InvalidRequest,
    SamplingParams,
    StructuredOutput,
)
from tests.engine.helpers import drain, make_engine, preload, running, text, tiny_config, tokens
from tests.model_fixtures import TinySetup

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
TOOL = {
    "type": "object",
    "properties": {
        "name": {"const": "lookup"},
        "arguments": {
            "type": "object",
            "properties": {"q": {"type": "string", "maxLength": 8}},
            "required": ["q"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


def test_constrained_rows_beside_free_rows_in_one_batch(llama: TinySetup) -> None:
    engine = make_engine(llama)
    preload(engine, llama)
    person = StructuredOutput(json.dumps(PERSON))
    tool = StructuredOutput(
        json.dumps(TOOL), begin="<tool_call>", end="</tool_call>", repeat=True, param="tools"
    )
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    requests = {
        "person-sql": (
            SamplingParams(max_tokens=120, temperature=0.9, seed=1, structured=person),
            "demo-sql",
        ),
        "person-base": (SamplingParams(max_tokens=120, temperature=0, structured=person), None),
        "object-poet": (
            SamplingParams(
                max_tokens=120, temperature=1.0, seed=3, structured=StructuredOutput('{"type": "object"}')
            ),
            "demo-poet",
        ),
        "tool-chef": (SamplingParams(max_tokens=160, temperature=0.7, seed=4, structured=tool), "demo-chef"),
        "free-sql": (free, "demo-sql"),
        "free-base": (free, None),
    }
    for rid, (params, adapter) in requests.items():
        engine.add_request(
            EngineRequest(rid, [5, 6, 7, 8, 9], params, None if adapter is None else llama.refs[adapter])
        )
    outputs = drain(engine)

    for rid in ("person-sql", "person-base"):
        assert outputs[rid][-1].finish_reason is FinishReason.STOP, text(outputs[rid])
        value = json.loads(text(outputs[rid]))
        jsonschema.validate(value, PERSON)
        assert text(outputs[rid]) == json.dumps(value, separators=(",", ":"), ensure_ascii=False)  # compact
    # Any object: its strings are unbounded, so a random model may run out of tokens inside one.
    poet = outputs["object-poet"][-1]
    if poet.finish_reason is FinishReason.STOP:
        assert isinstance(json.loads(text(outputs["object-poet"])), dict)
    else:
        assert poet.finish_reason is FinishReason.LENGTH and text(outputs["object-poet"]).startswith("{")
    calls = text(outputs["tool-chef"]).split("\n")
    assert calls and all(c.startswith("<tool_call>") and c.endswith("</tool_call>") for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.removeprefix("<tool_call>").removesuffix("</tool_call>")), TOOL)

    # The unconstrained neighbours decode exactly as they do alone.
    for rid, adapter in (("free-sql", "demo-sql"), ("free-base", None)):
        alone = make_engine(llama)
        alone.add_request(
            EngineRequest(rid, [5, 6, 7, 8, 9], free, None if adapter is None else llama.refs[adapter])
        )
        assert tokens(outputs[rid]) == tokens(drain(alone)[rid])
        alone.close()
    engine.close()


def test_a_grammar_survives_preemption_and_a_prefix_hit(llama: TinySetup) -> None:
    engine = make_engine(llama, num_kv_blocks=24, max_num_seqs=8)  # too few blocks for all: preemption
    prompt = list(range(30, 50))
    params = SamplingParams(
        max_tokens=60, temperature=1.0, seed=9, structured=StructuredOutput(json.dumps(PERSON))
    )
    engine.add_request(EngineRequest("p0", prompt, params))
    first = engine.step()  # p0's prompt is cached from here on
    for i in range(1, 6):
        engine.add_request(EngineRequest(f"p{i}", prompt, params))
    outputs = drain(engine)
    outputs["p0"] = first + outputs["p0"]
    assert engine.scheduler.num_preemptions > 0
    for rid, outs in outputs.items():
        usage = outs[-1].usage
        if rid != "p0":
            assert usage is not None and usage.cached_prompt_tokens > 0
        if outs[-1].finish_reason is FinishReason.STOP:
            jsonschema.validate(json.loads(text(outs)), PERSON)
    engine.close()


@pytest.fixture
def async_engine(llama: TinySetup):
    with running(tiny_config(llama)) as engine:
        yield engine


async def _collect(engine: AsyncEngine, request: EngineRequest) -> list:  # type: ignore[type-arg]
    return [out async for out in engine.generate(request)]


async def test_a_schema_that_cannot_be_enforced_is_refused_before_any_output(
    async_engine: AsyncEngine,
) -> None:
    bad = StructuredOutput(
        '{"type": "object", "properties": {"a": {"type": "strnig"}}}', param="response_format"
    )
    with pytest.raises(InvalidRequest) as refused:
        await _collect(async_engine, EngineRequest("bad", [1, 2, 3], SamplingParams(structured=bad)))
    assert refused.value.param == "response_format"
    assert async_engine.stats().running == 0 and async_engine.stats().waiting == 0


async def test_compiling_happens_off_the_engine_loop_and_a_slow_one_is_refused(
    llama: TinySetup, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = AsyncEngine(tiny_config(llama, grammar_compile_timeout_s=0.3))
    compile_threads: list[str] = []
    compile = engine.grammars.compile

    def slow(spec: StructuredOutput, tenant: str | None = None) -> CompiledGrammar:
        compile_threads.append(threading.current_thread().name)
        if "slow" in spec.json_schema:
            time.sleep(1.0)
        return compile(spec, tenant)

    monkeypatch.setattr(engine.grammars, "compile", slow)
    try:
        free = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        slow_spec = StructuredOutput('{"type": "object", "description": "slow"}')
        started = time.monotonic()
        results = await asyncio.gather(
            _collect(  # another tenant's: one tenant compiles on one grammar thread at a time
                engine, EngineRequest("slow", [1, 2], SamplingParams(structured=slow_spec), tenant="a")
            ),
            _collect(engine, EngineRequest("free", [3, 4], free)),
            return_exceptions=True,
        )
        assert isinstance(results[0], InvalidRequest) and "did not compile within" in str(results[0])
        assert not isinstance(results[1], BaseException) and results[1][-1].finished
        assert time.monotonic() - started < 5
        quick = StructuredOutput('{"type": "object"}')
        outs = await _collect(
            engine, EngineRequest("quick", [1, 2], SamplingParams(max_tokens=40, structured=quick))
        )
        assert outs[-1].finished
        assert compile_threads and all(name.startswith("grammar") for name in compile_threads)
    finally:
        engine.shutdown()


WAIT_S = 20.0  # how long a held compile waits for its release: reached only when a test fails


class HeldCompiles:
    """Wraps an engine's compiler: a schema whose description starts with "held" compiles only once
    `release` is set; records which (tenant, schema) compiles began and which ended."""

    def __init__(self, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        self.began: list[tuple[str | None, str]] = []
        self.ended: list[tuple[str | None, str]] = []
        compile = engine.grammars.compile

        def held(spec: StructuredOutput, tenant: str | None = None) -> CompiledGrammar:
            self.began.append((tenant, spec.json_schema))
            if '"held' in spec.json_schema:
                self.release.wait(WAIT_S)
            try:
                return compile(spec, tenant)
            finally:
                self.ended.append((tenant, spec.json_schema))

        monkeypatch.setattr(engine.grammars, "compile", held)

    async def until_began(self, count: int) -> None:
        for _ in range(int(WAIT_S / 0.01)):
            if len(self.began) >= count:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{count} compiles never began: {self.began}")


def held(name: str) -> StructuredOutput:
    return StructuredOutput(json.dumps({"type": "object", "description": f"held {name}"}))


def structured(rid: str, spec: StructuredOutput, tenant: str) -> EngineRequest:
    return EngineRequest(rid, [1, 2], SamplingParams(max_tokens=4, structured=spec), tenant=tenant)


@pytest.fixture
def bounded_engine(llama: TinySetup):
    config = tiny_config(llama, grammar_compile_timeout_s=1.0, grammar_compile_queue=4)  # share: 1
    with running(config) as engine:
        yield engine


async def test_the_wait_for_a_grammar_thread_counts_against_the_bound(
    bounded_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, compiles = bounded_engine, HeldCompiles(bounded_engine, monkeypatch)
    try:
        holding = [
            asyncio.create_task(_collect(engine, structured(f"h{i}", held(str(i)), f"t{i}"))) for i in (0, 1)
        ]
        await compiles.until_began(2)  # both grammar threads are held from here
        quick = StructuredOutput('{"type": "integer"}')
        with pytest.raises(EngineOverloaded):  # its bound passed in the queue: refused, never compiled
            await _collect(engine, structured("q", quick, "t2"))
        assert not compiles.release.is_set() and len(compiles.began) == 2
        for task in holding:  # these had started: their schemas are refused (400) ...
            with pytest.raises(InvalidRequest, match="did not compile within 1 s") as refused:
                await task
            assert refused.value.param == "response_format"
        with pytest.raises(InvalidRequest, match="did not compile within 1 s"):  # ... and stay refused
            await _collect(engine, structured("h0-again", held("0"), "t0"))
        assert len(compiles.began) == 2  # refused at once, without a compile
        compiles.release.set()
        outs = await _collect(engine, structured("q-again", quick, "t2"))
        assert outs[-1].finished
        stats = await engine.call(lambda e: e.stats())
        assert stats.grammar_refusals == {"busy": 1, "timeout": 3}
    finally:
        compiles.release.set()


async def test_one_tenants_compiles_never_make_anothers_wait_or_time_out(
    bounded_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, compiles = bounded_engine, HeldCompiles(bounded_engine, monkeypatch)
    try:
        cycling = asyncio.create_task(_collect(engine, structured("a0", held("a0"), "a")))
        await compiles.until_began(1)
        for i in (1, 2):  # the tenant's share of the queue is full: refused at once, not queued
            with pytest.raises(EngineOverloaded):
                await _collect(engine, structured(f"a{i}", held(f"a{i}"), "a"))
        # The other thread is never the cycling tenant's: b's compile runs now, beside a's held one.
        outs = await _collect(engine, structured("b", StructuredOutput('{"type": "integer"}'), "b"))
        assert outs[-1].finished and compiles.ended == [("b", '{"type": "integer"}')]
        # A long queue refuses at once too: c's held compile takes the free thread, four tenants queue.
        others = [asyncio.create_task(_collect(engine, structured(t, held(t), t))) for t in "cdefg"]
        await compiles.until_began(3)
        with pytest.raises(EngineOverloaded):
            await _collect(engine, structured("h", held("h"), "h"))
        assert not compiles.release.is_set()
        compiles.release.set()
        for task in [cycling, *others]:  # they had waited past their bound, or compiled in time
            await asyncio.gather(task, return_exceptions=True)
        stats = await engine.call(lambda e: e.stats())
        assert stats.grammar_refusals["busy"] >= 3
    finally:
        compiles.release.set()
