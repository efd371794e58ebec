"""Grammar-constrained decoding: a random model emits schema-valid compact JSON only because of the mask."""

import json
import threading
import time
from typing import Any

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bench.grammar_libraries import is_compact
from deployments.engine.errors import InvalidRequest
from deployments.engine.grammar import compiler as grammar_module
from deployments.engine.grammar.cache import GrammarCache
from deployments.engine.grammar.compiler import (
    MAX_ALTERNATIVES,
    MAX_ERROR_CHARS,
    MAX_OPTIONAL_RUN,
    CompiledGrammar,
    GrammarCompiler,
    GrammarMatcher,
    GrammarRefused,
    apply_bitmask,
    new_bitmask,
)
from deployments.engine.sampling_params import MAX_SCHEMA_CHARS, StructuredOutput
from tests.model_fixtures import TinySetup

PADDED = 64  # the model's logits are wider than the tokenizer: those columns must never be picked
TOOL = {
    "type": "object",
    "properties": {
        "name": {"const": "f"},
        "arguments": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
    },
    "required": ["name", "arguments"],
}
CALL = '<tool_call>{"name":"f","arguments":{"x":1}}</tool_call>'
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object"},
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
            "score": {"type": "number", "minimum": -1, "maximum": 1},
            "nick": {"type": "string", "pattern": "^[a-z]{2,4}$"},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
    {
        "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
        "type": "object",
        "properties": {
            "at": {"anyOf": [{"$ref": "#/$defs/pt"}, {"type": "null"}]},
            "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
        },
        "required": ["at", "inner"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
]


@pytest.fixture(scope="module")
def tokenizer(llama: TinySetup) -> PreTrainedTokenizerBase:
    loaded: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(llama.model_dir)
    return loaded


@pytest.fixture(scope="module")
def compiler(tokenizer: PreTrainedTokenizerBase) -> GrammarCompiler:
    assert tokenizer.eos_token_id is not None
    return GrammarCompiler(tokenizer, len(tokenizer) + PADDED, [tokenizer.eos_token_id], cache_size=8)


def spec(schema: dict[str, Any] | str, **kw: Any) -> StructuredOutput:
    return StructuredOutput(schema if isinstance(schema, str) else json.dumps(schema), **kw)


def decode(matcher: GrammarMatcher, tokenizer: PreTrainedTokenizerBase, vocab: int, seed: int) -> str:
    """A random model under the mask, greedy; late on, tokens that close things are favoured so that an
    unbounded string or array ends within the budget (the mask alone decides what is allowed)."""
    generator = torch.Generator().manual_seed(seed)
    closing = torch.zeros(vocab, dtype=torch.bool)
    closing[: len(tokenizer)] = torch.tensor(
        [any(c in tokenizer.decode([t]) for c in '"]}') for t in range(len(tokenizer))]
    )
    closing[tokenizer.eos_token_id] = True
    bitmask, tokens = new_bitmask(2, vocab), list[int]()
    for step in range(300):
        logits = torch.randn(2, vocab, generator=generator)
        logits[:, len(tokenizer) :] = 100.0  # padding columns would win every argmax if left unmasked
        if step > 60:
            logits[:, closing] += 8.0
        matcher.fill_mask(bitmask, 1)  # row 1: rows are independent
        apply_bitmask(logits, bitmask)
        token = int(logits[1].argmax())
        assert matcher.accept(token), token
        if matcher.terminated:
            assert token == tokenizer.eos_token_id
            text = tokenizer.decode(tokens)
            assert isinstance(text, str)
            return text
        tokens.append(token)
    raise AssertionError(f"no end after 300 tokens: {tokenizer.decode(tokens)!r}")


def fed(
    compiled: CompiledGrammar, tokenizer: PreTrainedTokenizerBase, text: str, *, eos: bool = True
) -> bool:
    matcher = compiled.matcher()
    tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id] * eos
    return all(matcher.accept(t) for t in tokens) and (matcher.terminated or not eos)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_a_random_model_under_the_mask_writes_compact_json_that_validates(
    index: int, compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    schema = SCHEMAS[index]
    compiled = compiler.compile(spec(schema))
    for seed in range(3):
        text = decode(compiled.matcher(), tokenizer, compiler.vocab_size, seed)
        jsonschema.validate(json.loads(text), schema)
        assert is_compact(text), text


def test_json_object_mode_takes_compact_json_only(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    compiled = compiler.compile(spec('{"type": "object"}'))
    assert fed(compiled, tokenizer, '{"a":1}')
    assert fed(compiled, tokenizer, '{"a":[1,2,{"b":null}],"c":"x y"}')
    assert not fed(compiled, tokenizer, '{"a": 1}')
    assert not fed(compiled, tokenizer, '{"a":1, "b":2}')
    assert not fed(compiled, tokenizer, "[1]")
    assert not fed(compiled, tokenizer, '{"a":1} ')
    assert not fed(compiled, tokenizer, '{"a":1', eos=True)  # EOS before the JSON is whole


def test_a_refused_token_leaves_only_the_stop_tokens(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    matcher = compiler.compile(spec('{"type": "object"}')).matcher()
    assert not matcher.accept(tokenizer.encode("x", add_special_tokens=False)[0])
    assert matcher.error is not None and not matcher.terminated
    bitmask = new_bitmask(1, compiler.vocab_size)
    matcher.fill_mask(bitmask, 0)
    logits = torch.zeros(1, compiler.vocab_size)
    apply_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [tokenizer.eos_token_id]


def test_after_the_json_only_eos_is_allowed(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    matcher = compiler.compile(spec(TOOL)).matcher()
    for token in tokenizer.encode('{"name":"f","arguments":{"x":12}}', add_special_tokens=False):
        assert matcher.accept(token)
    assert matcher.completed and not matcher.terminated
    bitmask = new_bitmask(1, compiler.vocab_size)
    matcher.fill_mask(bitmask, 0)
    logits = torch.zeros(1, compiler.vocab_size)
    apply_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    assert matcher.accept(tokenizer.eos_token_id) and matcher.terminated
    assert not matcher.accept(tokenizer.eos_token_id)


def test_tool_call_blocks_and_their_repetition(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    once = compiler.compile(spec(TOOL, begin="<tool_call>", end="</tool_call>"))
    repeated = compiler.compile(spec(TOOL, begin="<tool_call>", end="</tool_call>", repeat=True))
    assert fed(once, tokenizer, CALL) and fed(repeated, tokenizer, CALL)
    assert not fed(once, tokenizer, CALL + "\n" + CALL)
    assert fed(repeated, tokenizer, CALL + "\n" + CALL + "\n" + CALL)
    assert not fed(repeated, tokenizer, CALL + "\n\n" + CALL)
    assert not fed(repeated, tokenizer, CALL + "\n")
    assert not fed(once, tokenizer, '<tool_call>{"name":"g","arguments":{"x":1}}</tool_call>')
    assert not fed(once, tokenizer, '<tool_call> {"name":"f","arguments":{"x":1}}</tool_call>')
    assert not fed(once, tokenizer, '{"name":"f","arguments":{"x":1}}')
    text = decode(repeated.matcher(), tokenizer, compiler.vocab_size, seed=0)
    for block in text.split("\n"):
        assert block.startswith("<tool_call>") and block.endswith("</tool_call>"), text
        jsonschema.validate(json.loads(block.removeprefix("<tool_call>").removesuffix("</tool_call>")), TOOL)


def test_begin_and_end_texts_are_literal(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    odd = 'a "quoted" \\ \n é 🎉 '
    compiled = compiler.compile(spec({"type": "integer"}, begin=odd, end=odd))
    assert fed(compiled, tokenizer, f"{odd}42{odd}")
    assert not fed(compiled, tokenizer, "42")


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ('{"type": "array", "uniqueItems": true}', "uniqueItems"),
        ('{"type": "integer", "not": {"const": 1}}', "not"),
        ('{"if": {"type": "string"}, "then": {"maxLength": 2}}', "if"),
        ('{"type": "object", "propertyNames": {"maxLength": 2}}', "propertyNames"),
        ('{"type": "bogus"}', "bogus"),
        ('{"$ref": "#/$defs/missing"}', "missing"),
        ('{"type": "string", "pattern": "(a"}', "regex"),
        ('{"type": "object"', "not valid JSON"),
        ("[1, 2]", "must be an object"),
    ],
)
def test_a_schema_that_cannot_be_enforced_is_an_invalid_request_naming_why(
    schema: str, named: str, compiler: GrammarCompiler
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        compiler.compile(StructuredOutput(schema, param="tools"))
    assert caught.value.param == "tools"
    assert named in str(caught.value) and len(str(caught.value)) <= MAX_ERROR_CHARS
    with pytest.raises(InvalidRequest) as again:  # the failure is cached, the field is this request's
        compiler.compile(StructuredOutput(schema, param="response_format"))
    assert again.value.param == "response_format" and str(again.value) == str(caught.value)


def test_a_long_error_is_cut_short(compiler: GrammarCompiler) -> None:
    schema = json.dumps({"type": "string", "pattern": "(" + "a" * 2000})
    with pytest.raises(InvalidRequest) as caught:
        compiler.compile(StructuredOutput(schema))
    assert len(str(caught.value)) == MAX_ERROR_CHARS and str(caught.value).endswith("...")


def test_the_cache_returns_the_same_grammar_and_stays_bounded(tokenizer: PreTrainedTokenizerBase) -> None:
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_size=2)
    first = compiler.compile(spec(TOOL))
    assert compiler.compile(spec(TOOL, param="tools")) is first  # `param` is not part of the grammar
    assert compiler.compile(spec(TOOL, begin="<b>")) is not first
    compiler.compile(spec({"type": "integer"}))
    assert compiler.cache_len() == 2
    assert compiler.compile(spec(TOOL)) is not first  # evicted (least recently used), compiled again


def test_compiling_from_many_threads_agrees(tokenizer: PreTrainedTokenizerBase) -> None:
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    results: list[CompiledGrammar] = []

    def work() -> None:
        results.append(compiler.compile(spec(SCHEMAS[1])))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(r) for r in results}) == 1 and len(results) == 4


def test_the_largest_schema_a_request_may_carry_compiles_in_bounded_time(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    properties: dict[str, Any] = {
        f"p{i}": {"type": "string", "pattern": f"^[a-z]{{1,{i % 20 + 1}}}[0-9]$"}
        for i in range(MAX_ALTERNATIVES)
    }
    schema = {"type": "object", "properties": properties, "required": ["p0"]}
    assert MAX_SCHEMA_CHARS / 2 < len(json.dumps(schema)) < MAX_SCHEMA_CHARS
    start = time.perf_counter()
    compiled = compiler.compile(spec(schema))
    assert time.perf_counter() - start < 5.0
    assert fed(compiled, tokenizer, '{"p0":"a1","p1":"b2","p899":"c3"}')
    assert not fed(compiled, tokenizer, '{"p0":"ab1"}')
    properties["one_more"] = {}  # past the parser's row bound: refused now, not at the request's first token
    with pytest.raises(InvalidRequest, match="901 properties"):
        compiler.compile(spec(schema))
    # StructuredOutput itself refuses anything longer
    with pytest.raises(InvalidRequest):
        spec({"type": "object", "description": "x" * MAX_SCHEMA_CHARS})


def test_the_compiler_refuses_a_vocab_smaller_than_the_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        GrammarCompiler(tokenizer, len(tokenizer) - 1, [tokenizer.eos_token_id])


def test_apply_bitmask_masks_what_the_bits_and_the_padding_say() -> None:
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 - 2**31  # bits 0 and 31 (the sign bit): tokens 0 and 31
    bitmask[1, 1] = 1 << 3  # token 35
    logits = torch.zeros(2, 70)  # wider than the mask's 64 columns
    apply_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 31]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [35]
    narrow = torch.zeros(1, 40)  # narrower than the mask: only its own columns are touched
    apply_bitmask(narrow, new_bitmask(1, 40))
    assert torch.isfinite(narrow).all()


def optional_properties(count: int, prefix: str = "p", **extra: Any) -> dict[str, Any]:
    properties = {f"{prefix}{i}": {"type": "integer"} for i in range(count)}
    return {"type": "object", "properties": properties, **extra}


def test_an_object_opened_by_too_many_optional_properties_is_refused_when_compiled(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    # The library fails a request at the object's "{" from 499 optional properties on (a row of 4k + 7
    # items past its 2000): refused here instead, wherever the object is.
    largest = compiler.compile(spec(optional_properties(MAX_OPTIONAL_RUN)))
    assert fed(largest, tokenizer, '{"p0":1,"p497":2}')  # the bound is the library's, not tighter
    nested = {"type": "object", "properties": {"a": optional_properties(MAX_OPTIONAL_RUN + 1)}}
    for schema in (optional_properties(MAX_OPTIONAL_RUN + 1), nested, {"type": "array", "items": nested}):
        with pytest.raises(GrammarRefused, match="first 499 properties are optional") as refused:
            compiler.compile(spec(schema, param="tools"))
        assert refused.value.param == "tools" and refused.value.reason == "schema"
    # A required property ends the run: what comes after it opens nothing at "{".
    compiler.compile(spec(optional_properties(MAX_ALTERNATIVES, required=["p0"])))
    compiler.compile(spec(optional_properties(MAX_ALTERNATIVES, required=[f"p{MAX_OPTIONAL_RUN}"])))


def test_a_grammar_the_library_would_fail_at_its_first_token_is_refused_when_compiled(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two objects of 300 optional properties each pass the width checks, but an anyOf of them opens
    # 2414 items at "{": the probe of the first token finds what only the library knows.
    two = {"anyOf": [optional_properties(300), optional_properties(300, "q")]}
    for kw in ({}, {"begin": "<tool_call>", "end": "</tool_call>", "repeat": True}):
        with pytest.raises(GrammarRefused, match="opens 2414 alternatives at once") as refused:
            compiler.compile(spec(two, param="response_format", **kw))
        assert refused.value.param == "response_format" and "left-recursive" not in str(refused.value)
    # The probe alone, with the structural bound out of the way, refuses one optional property too many.
    monkeypatch.setattr(grammar_module, "MAX_OPTIONAL_RUN", 10_000)
    with pytest.raises(GrammarRefused, match="opens 2003 alternatives"):
        compiler.compile(spec(optional_properties(MAX_OPTIONAL_RUN + 1, description="not cached")))
    one_less = compiler.compile(spec(optional_properties(MAX_OPTIONAL_RUN, description="not cached")))
    assert fed(one_less, tokenizer, '{"p1":1}')


def test_a_refusal_holds_for_its_ttl_for_its_tenant_only_then_the_schema_compiles(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    now = [100.0]
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], clock=lambda: now[0])
    slow = spec(TOOL, param="tools")
    compiler.refuse(slow, "tenant-a", "the schema did not compile within 10 s; simplify it", ttl_s=60)
    for _ in range(2):  # refused at once, again and again, without compiling: nothing is built
        with pytest.raises(GrammarRefused, match="did not compile") as refused:
            compiler.compile(slow, "tenant-a")
        assert refused.value.reason == "timeout" and refused.value.param == "tools"
    assert compiler.cache_len() == 1
    assert compiler.compile(slow, "tenant-b") is not None  # another tenant's equal schema is its own
    now[0] += 59.9
    with pytest.raises(GrammarRefused):
        compiler.lookup(slow, "tenant-a")
    now[0] += 0.2  # past the TTL: the schema compiles and is served from the cache
    compiled = compiler.compile(slow, "tenant-a")
    assert compiler.lookup(slow, "tenant-a") is compiled
    # A schema refused for what it is stays refused: no TTL.
    with pytest.raises(GrammarRefused) as forever:
        compiler.compile(spec('{"type": "bogus"}'), "tenant-a")
    assert forever.value.reason == "schema"
    now[0] += 10**6
    with pytest.raises(GrammarRefused):
        compiler.lookup(spec('{"type": "bogus"}'), "tenant-a")


def test_a_compile_that_ends_during_its_refusal_does_not_lift_it(tokenizer: PreTrainedTokenizerBase) -> None:
    now = [0.0]
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], clock=lambda: now[0])
    slow = spec(TOOL)
    built = compiler._build(slow)  # a compile that was running when its bound passed...
    compiler.refuse(slow, "a", "too slow", ttl_s=60)
    assert compiler._cache.put("a", compiler.key(slow), built) is not built  # ...ends: the refusal stays
    with pytest.raises(GrammarRefused, match="too slow"):
        compiler.lookup(slow, "a")


def test_a_tenant_cycling_schemas_never_evicts_another_tenants_grammars(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_size=64)
    kept = [compiler.compile(spec(schema), "tenant-b") for schema in SCHEMAS[:3]]
    for i in range(1000):
        compiler.compile(spec({"type": "integer", "minimum": i}), "tenant-a")
    assert compiler.cache_len() <= 64 and compiler._cache.held_by("tenant-a") == 32
    assert [compiler.lookup(spec(schema), "tenant-b") for schema in SCHEMAS[:3]] == kept


def test_the_cache_gives_each_tenant_a_bounded_share_and_evicts_from_the_largest_holder() -> None:
    cache: GrammarCache[int] = GrammarCache(size=10, share=4)
    for i in range(2):
        cache.put("small", i, i)
    for i in range(100):  # one tenant cycling: only its own share churns
        cache.put("cycler", i, i)
    assert cache.held_by("cycler") == 4 and cache.held_by("small") == 2
    for tenant in ("t1", "t2"):  # the cache fills: the largest holders give way, not the small one
        for i in range(4):
            cache.put(tenant, i, i)
    assert len(cache) == 10 and cache.held_by("small") == 2
    assert [cache.get("small", i) for i in range(2)] == [0, 1]
    assert cache.held_by("cycler") == 2 and cache.get("cycler", 99) == 99  # its least recently used went
    assert cache.put("small", 0, 42) == 0  # the first stored wins while it lives


def test_an_expired_entry_is_gone_and_can_be_replaced() -> None:
    now = [0.0]
    cache: GrammarCache[str] = GrammarCache(size=4, share=4, clock=lambda: now[0])
    cache.put(None, "k", "refused", ttl_s=5)
    assert cache.put(None, "k", "grammar") == "refused"
    now[0] = 5.0
    assert cache.get(None, "k") is None and len(cache) == 0
    assert cache.put(None, "k", "grammar") == "grammar"
