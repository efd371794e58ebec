"""JSON-Schema constrained decoding: xgrammar against llguidance, on this CPU, with the demo tokenizer.

Per library: compile time of ~30 varied schemas (p50/p99; for llguidance "compile" is building a matcher,
which is all the work it does up front), the per-token cost of a mask (bitmask fill, and applying it to a
[1, V] float32 logits row) while a random model decodes under the mask, and coverage: per keyword probe,
whether the library rejects the schema, compiles it and enforces it (every output validates), or compiles
it and ignores it (some output breaks the schema). Outputs are also checked to be compact JSON (no
whitespace between JSON tokens), which the engine asks for. Each library's compilation runs on one thread.
The timings run in rounds, the libraries in turns (A B, B A, ...), each round every schema compiled cold
and decoded; per library the percentiles pool every round, and the xgrammar/llguidance ratios of the
compile and fill p50s are taken per round (median and spread).

Run: python -m bench.grammar_libraries [--tiny] [--model-vocab N] [--samples 3] [--repeats 3]
xgrammar is not a project dependency (the engine uses llguidance): `pip install xgrammar==0.2.8` to compare;
without it its entry says "skipped".
The last line is one JSON object: per library its numbers, their ratios, the machine, the vocabulary and
the choice.
"""

import argparse
import importlib.metadata
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import llguidance.hf
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from app.modelprep.demo_model import build_tokenizer
from bench.measure import Interleaved, machine, spread
from deployments.engine.grammar.compiler import LIBRARY, apply_bitmask, new_bitmask

S = {"type": "string", "maxLength": 12}
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object"},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "object", "properties": {"a": S, "b": {"type": "boolean"}}, "required": ["a"]},
    {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["n"],
    },
    {
        "type": "object",
        "properties": {"x": {"type": "number", "minimum": -1.5, "maximum": 2.5}},
        "required": ["x"],
    },
    {"type": "object", "properties": {"c": {"enum": ["red", "green", "blue"]}}, "required": ["c"]},
    {
        "type": "object",
        "properties": {"k": {"const": "fixed"}, "v": {"type": "null"}},
        "required": ["k", "v"],
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": S, "maxItems": 3},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": S, "minItems": 2, "maxItems": 2}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {"id": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"}},
        "required": ["id"],
    },
    {
        "type": "object",
        "properties": {
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "city": {"type": "string", "minLength": 1, "maxLength": 10},
        },
        "required": ["zip", "city"],
    },
    {
        "type": "object",
        "properties": {
            "u": {
                "type": "object",
                "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
                "required": ["name", "age"],
            }
        },
        "required": ["u"],
    },
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {"type": "object", "properties": {"c": {"type": "integer"}}, "required": ["c"]}
                },
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    {"anyOf": [{"type": "integer"}, S]},
    {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "null"}, S]}},
        "required": ["v"],
    },
    {
        "type": "object",
        "properties": {
            "shape": {
                "anyOf": [
                    {"type": "object", "properties": {"r": {"type": "number"}}, "required": ["r"]},
                    {
                        "type": "object",
                        "properties": {"w": {"type": "number"}, "h": {"type": "number"}},
                        "required": ["w", "h"],
                    },
                ]
            }
        },
        "required": ["shape"],
    },
    {
        "$defs": {
            "pt": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}},
        "required": ["from", "to"],
    },
    {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
                },
                "required": ["v", "next"],
            }
        },
        "$ref": "#/$defs/node",
    },
    {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {
                "type": "object",
                "properties": {"city": S, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
        "required": ["name", "arguments"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["sku", "qty"],
                },
            }
        },
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "err": S},
        "required": ["ok"],
        "additionalProperties": False,
    },
    {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": 10, "maximum": 99},
    {
        "type": "object",
        "properties": {"p": {"type": "string", "pattern": "^(ab|cd)+$", "maxLength": 8}},
        "required": ["p"],
    },
    {
        "type": "object",
        "properties": {
            "m": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
                "maxItems": 2,
            }
        },
        "required": ["m"],
    },
    {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "integer"},
            "c": S,
            "d": {"type": "boolean"},
            "e": {"type": "number"},
            "f": {"enum": [1, 2, 3]},
        },
        "required": ["a", "c", "e"],
    },
    {
        "type": "object",
        "properties": {
            "when": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
        },
        "required": ["when", "n"],
    },
    {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "object", "properties": {"b": S}, "required": ["b"]},
        ]
    },
]
# One keyword each; the outputs decoded under the mask tell whether it was enforced.
PROBES: dict[str, dict[str, Any]] = {
    "format": {
        "type": "object",
        "properties": {"d": {"type": "string", "format": "date"}},
        "required": ["d"],
    },
    "patternProperties": {
        "type": "object",
        "patternProperties": {"^x_[0-9]$": {"type": "integer"}},
        "additionalProperties": False,
        "minProperties": 1,
    },
    "uniqueItems": {
        "type": "array",
        "items": {"enum": [1, 2]},
        "minItems": 2,
        "maxItems": 2,
        "uniqueItems": True,
    },
    "if/then": {
        "type": "object",
        "properties": {"a": {"enum": [1, 2]}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "if": {"properties": {"a": {"const": 1}}},
        "then": {"properties": {"b": {"const": 7}}},
    },
    "not": {"type": "integer", "minimum": 0, "maximum": 3, "not": {"enum": [0, 1, 2]}},
    "multipleOf": {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 7},
    "minProperties": {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
    "propertyNames": {
        "type": "object",
        "propertyNames": {"pattern": "^[a-c]$"},
        "additionalProperties": {"type": "integer"},
        "minProperties": 1,
    },
    "dependentRequired": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a"],
        "dependentRequired": {"a": ["b"]},
    },
    "contains": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 5},
        "contains": {"const": 5},
        "maxItems": 3,
    },
    "prefixItems": {
        "type": "array",
        "prefixItems": [{"type": "integer"}, {"type": "boolean"}],
        "items": False,
        "minItems": 2,
    },
    "oneOf": {
        "oneOf": [
            {"type": "integer", "minimum": 0, "maximum": 5},
            {"type": "integer", "minimum": 3, "maximum": 9},
        ]
    },
    "compact untyped values": {"type": "object", "properties": {"any": {}}, "required": ["any"]},
}
# Fed token by token: an untyped value (and json_object mode) must take compact JSON and refuse blanks.
COMPACT = ('{"any":[1,2,{"a":1,"b":[]}]}', '{"any":[1, 2]}')
TINY_SCHEMAS = [0, 1, 7, 11, 17, 19]
TINY_PROBES = ["format", "uniqueItems", "compact untyped values"]


@dataclass
class Library:
    """One library behind the few calls the bench makes."""

    name: str
    compile: Callable[[str], Any]  # schema text -> compiled grammar (raises if rejected)
    matcher: Callable[[Any], Any]
    fill: Callable[[Any, torch.Tensor], None]  # fills row 0
    accept: Callable[[Any, int], bool]
    done: Callable[[Any], bool]  # the stop token was accepted (llguidance: or nothing else may follow)


def xgrammar_library(tokenizer: PreTrainedTokenizerBase, vocab: int, eos: int) -> Library:
    import xgrammar  # not a project dependency (it pulls ~1 GB of triton): pip install xgrammar==0.2.8

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_schema(schema: str) -> Any:
        return compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))

    return Library(
        "xgrammar", compile_schema, xgrammar.GrammarMatcher,
        lambda m, bitmask: m.fill_next_token_bitmask(bitmask, 0),
        lambda m, token: m.accept_token(token), lambda m: m.is_terminated(),
    )  # fmt: skip


def llguidance_library(tokenizer: PreTrainedTokenizerBase, vocab: int, eos: int) -> Library:
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)

    def compile_schema(schema: str) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(m: Any, bitmask: torch.Tensor) -> None:
        m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.shape[1] * 4)

    return Library(
        "llguidance", compile_schema, lambda compiled: compiled.deep_copy(), fill,
        lambda m, token: m.consume_token(token), lambda m: m.is_stopped(),
    )  # fmt: skip


def closing_tokens(tokenizer: PreTrainedTokenizerBase, vocab: int) -> torch.Tensor:
    """[vocab] bool: the tokens that close strings, arrays and objects, and EOS."""
    closers = torch.tensor(
        [any(c in tokenizer.decode([t]) for c in '"]}') for t in range(len(tokenizer))]
        + [False] * (vocab - len(tokenizer))
    )
    closers[tokenizer.eos_token_id] = True
    return closers


def decode(
    lib: Library,
    compiled: Any,
    tokenizer: PreTrainedTokenizerBase,
    closers: torch.Tensor,
    seed: int,
    budget: int,
) -> tuple[str | None, list[float], list[float]]:
    """A random model decodes under the mask (argmax); after budget/2 tokens, `closers` are favoured so that
    most runs finish. (text or None, fill us, apply us)."""
    vocab = len(closers)
    generator = torch.Generator().manual_seed(seed)
    matcher, bitmask, tokens = lib.matcher(compiled), new_bitmask(1, vocab), list[int]()
    fills: list[float] = []
    applies: list[float] = []
    for step in range(budget):
        logits = torch.randn(1, vocab, generator=generator)
        if step >= budget // 2:
            logits[0, closers] += 6.0
        start = time.perf_counter()
        lib.fill(matcher, bitmask)
        middle = time.perf_counter()
        apply_bitmask(logits, bitmask)
        fills.append((middle - start) * 1e6)
        applies.append((time.perf_counter() - middle) * 1e6)
        token = int(logits.argmax())
        if not lib.accept(matcher, token):
            raise AssertionError(f"{lib.name} refused token {token} that its own mask allowed")
        if token == tokenizer.eos_token_id:
            assert lib.done(matcher), f"{lib.name} accepted EOS but did not end"
            return str(tokenizer.decode(tokens)), fills, applies
        tokens.append(token)
    return None, fills, applies


def fed(lib: Library, compiled: Any, tokenizer: PreTrainedTokenizerBase, text: str) -> bool:
    """Whether the grammar takes `text` (as the tokenizer splits it) and then EOS."""
    matcher = lib.matcher(compiled)
    tokens = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    return all(lib.accept(matcher, token) for token in tokens)


def is_compact(text: str) -> bool:
    """No whitespace outside JSON strings."""
    in_string = escaped = False
    for char in text:
        if in_string:
            in_string, escaped = (True, False) if escaped else (char != '"', char == "\\")
        elif char == '"':
            in_string = True
        elif char.isspace():
            return False
    return True


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class Tally:
    """One library's samples over every round. Decoding is deterministic (seeded, argmax), so the outputs
    are checked in the first round only."""

    compile_ms: list[float] = field(default_factory=list)
    fills: list[float] = field(default_factory=list)
    applies: list[float] = field(default_factory=list)
    round_fill_p50: list[float] = field(default_factory=list)
    rounds: int = 0
    invalid: int = 0
    loose: int = 0
    unfinished: int = 0
    rejected: list[str] = field(default_factory=list)


def timing_round(
    lib: Library,
    tokenizer: PreTrainedTokenizerBase,
    closers: torch.Tensor,
    args: argparse.Namespace,
    tally: Tally,
) -> float:
    """Every schema compiled cold and decoded; the round's compile p50 (ms)."""
    schemas = [SCHEMAS[i] for i in TINY_SCHEMAS] if args.tiny else SCHEMAS
    first, compile_ms, fills = tally.rounds == 0, list[float](), list[float]()
    for index, schema in enumerate(schemas):
        text = json.dumps(schema)
        start = time.perf_counter()
        try:
            compiled = lib.compile(text)
        except Exception as error:
            if first:
                tally.rejected.append(f"schema {index}: {str(error)[:120]}")
            continue
        compile_ms.append((time.perf_counter() - start) * 1e3)
        for seed in range(args.samples):
            output, f, a = decode(lib, compiled, tokenizer, closers, seed, args.budget)
            fills += f
            tally.applies += a
            if not first:
                continue
            if output is None:
                tally.unfinished += 1
                continue
            try:
                jsonschema.validate(json.loads(output), schema)
            except (ValueError, jsonschema.ValidationError):
                tally.invalid += 1
            else:
                tally.loose += not is_compact(output)
    tally.rounds += 1
    tally.compile_ms += compile_ms
    tally.fills += fills
    tally.round_fill_p50.append(statistics.median(fills) if fills else float("nan"))
    return statistics.median(compile_ms) if compile_ms else float("nan")


def coverage(
    lib: Library, tokenizer: PreTrainedTokenizerBase, closers: torch.Tensor, args: argparse.Namespace
) -> dict[str, str]:
    """Per keyword probe: rejected, enforced, ignored or not compact."""
    probes = {k: PROBES[k] for k in TINY_PROBES} if args.tiny else PROBES
    verdicts: dict[str, str] = {}
    for keyword, schema in probes.items():
        try:
            compiled = lib.compile(json.dumps(schema))
        except Exception as error:
            verdicts[keyword] = "rejected: " + " ".join(str(error).split())[:100]
            continue
        verdict = "enforced"
        if keyword == "compact untyped values":
            good, spaced = (fed(lib, compiled, tokenizer, text) for text in COMPACT)
            if not good or spaced:
                verdict = f"not compact: accepts {COMPACT[0]!r}: {good}, {COMPACT[1]!r}: {spaced}"
        for seed in range(max(4, args.samples)) if verdict == "enforced" else ():
            output, _, _ = decode(lib, compiled, tokenizer, closers, seed, args.budget)
            if output is None:
                continue
            try:
                jsonschema.validate(json.loads(output), schema)
            except (ValueError, jsonschema.ValidationError):
                verdict = f"ignored (e.g. {output[:40]})"
                break
            if not is_compact(output):
                verdict = f"not compact (e.g. {output[:40]})"
                break
        verdicts[keyword] = verdict
    return verdicts


def summary(tally: Tally, round_compile_p50: list[float]) -> dict[str, Any]:
    compile_ms, fills = tally.compile_ms, tally.fills
    return {
        "compile_p50_ms": round(statistics.median(compile_ms), 2) if compile_ms else None,
        "compile_p99_ms": round(percentile(compile_ms, 0.99), 2) if compile_ms else None,
        "compile_max_ms": round(max(compile_ms), 2) if compile_ms else None,
        "compile_p50_ms_rounds": spread(round_compile_p50) if compile_ms else None,
        "compiled": len(compile_ms) // tally.rounds,
        "rejected": tally.rejected,
        "fill_p50_us": round(statistics.median(fills), 1),
        "fill_p99_us": round(percentile(fills, 0.99), 1),
        "fill_mean_us": round(statistics.fmean(fills), 1),
        "fill_p50_us_rounds": spread(tally.round_fill_p50),
        "apply_p50_us": round(statistics.median(tally.applies), 1),
        "tokens": len(fills) // tally.rounds,
        "rounds": tally.rounds,
        "outputs_invalid": tally.invalid,
        "outputs_not_compact": tally.loose,
        "outputs_unfinished": tally.unfinished,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tiny", action="store_true", help="six schemas, three probes: checks the bench runs"
    )
    parser.add_argument("--model-vocab", type=int, default=0, help="logits width (default: the tokenizer's)")
    parser.add_argument("--samples", type=int, default=3, help="decodes per schema")
    parser.add_argument("--budget", type=int, default=160, help="tokens per decode at most")
    parser.add_argument("--repeats", type=int, default=3, help="timing rounds of every library")
    args = parser.parse_args()
    if args.tiny:
        args.samples, args.budget, args.repeats = 1, 96, 2
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        build_tokenizer(Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(tmp)
    vocab = max(args.model_vocab, len(tokenizer))
    host = machine()
    print(f"cpu: {host['cpu']} ({host['cores']} cores), isa: {', '.join(host['isa']) or 'baseline'}")
    print(f"tokenizer: demo byte-level BPE, {len(tokenizer)} tokens; logits width {vocab}")
    result: dict[str, Any] = {"tokenizer_vocab": len(tokenizer), "logits_width": vocab}
    eos, closers = tokenizer.eos_token_id, closing_tokens(tokenizer, vocab)
    libs: dict[str, Library] = {}
    for make in (xgrammar_library, llguidance_library):
        try:
            lib = make(tokenizer, vocab, eos)
        except ImportError as error:
            result[make.__name__.removesuffix("_library")] = {"skipped": str(error)}
            continue
        libs[lib.name] = lib
    tallies = {name: Tally() for name in libs}
    runs = Interleaved(
        {
            name: partial(timing_round, lib, tokenizer, closers, args, tallies[name])
            for name, lib in libs.items()
        },
        repeats=args.repeats,
    ).run()
    for name, lib in libs.items():
        result[name] = {
            **summary(tallies[name], runs.samples[name]),
            "coverage": coverage(lib, tokenizer, closers, args),
            "version": importlib.metadata.version(name),
        }
        print(name, json.dumps(result[name], indent=1))
    if len(libs) == 2:  # per round: how many times llguidance's time xgrammar's is
        fill = zip(tallies["xgrammar"].round_fill_p50, tallies["llguidance"].round_fill_p50, strict=True)
        result["xgrammar_vs_llguidance"] = {
            "compile_p50": runs.ratio("xgrammar", "llguidance"),
            "fill_p50": spread([x / g for x, g in fill]),
        }
    result["chosen"] = LIBRARY  # what deployments/engine/grammar/compiler.py uses; see docs/decisions.md
    result["machine"] = host
    print(json.dumps(result))


if __name__ == "__main__":
    main()
