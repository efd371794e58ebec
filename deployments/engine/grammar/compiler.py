"""Grammar-constrained decoding: a `StructuredOutput` becomes a token mask per step, one row per request.

The only engine module that imports the grammar library, llguidance (chosen by bench/grammar_libraries.py;
see docs/decisions.md): it rejects the JSON Schema keywords it cannot enforce instead of ignoring them,
and every output decoded under its mask validated. The output is compact JSON (no whitespace between
JSON tokens, "," and ":" separators), optionally as begin + JSON + end, and with `repeat` one or more such
blocks separated by "\\n". With `triggered` (tool_choice "auto"), any text, or text then the block(s): the
text is a lazy lexeme ended by the first `begin`, so the grammar commits to a block there (llguidance's own
pattern for tool calls in running text). Once the grammar is complete, only the stop (EOS) tokens are allowed.

Use: `GrammarCompiler.lookup(spec, tenant)` (cheap: the cache) then `compile(spec, tenant)` (blocking,
thread-safe) off the engine loop thread; per request `compiled.matcher()`; per step
`matcher.fill_mask(bitmask, row)` into a `new_bitmask(rows, V)`, `apply_bitmask(logits, bitmask)`, then
`matcher.accept(token)` for the token sampled.

Compile work is bounded by the library's own meters (`_LIMITS`: regex fuel, grammar size, lexer states),
which refuse the same schema the same way on any machine and load; such refusals are cached for good. A
schema is also refused when it compiles but would fail at its first token (`_probe_opening`).
Bitmask layout (llguidance's and xgrammar's): int32 words, bit i of word j allows token 32 * j + i.
"""

import json
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from deployments.engine.errors import InvalidRequest
from deployments.engine.grammar.cache import GrammarCache, Tenant
from deployments.engine.grammar.closing import Closer, Fuel, Lexical, Trigger
from deployments.engine.sampling_params import StructuredOutput

log = logging.getLogger(__name__)

LIBRARY = "llguidance"
MAX_ERROR_CHARS = 300
# Compact JSON, in place of any "x-guidance" the schema carries (a request could use it to allow blanks);
# unimplemented keywords are errors, never silently dropped.
_JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ",",
    "key_separator": ":",
    "lenient": False,
}
# Compile and per-step work, metered by the library rather than timed: the values are its 1.9.1 defaults,
# sized for schemas of megabytes (ours are at most 64 KiB), pinned so that a library upgrade cannot loosen
# them. Compile: regex fuel (~50k per ms), grammar symbols, lexer states (~1-2 kB each); per mask: lexer
# fuel (~14k per ms) and Earley items (~20k per ms). Errors must not echo parser state or the grammar.
_LIMITS = llguidance.LLParserLimits(
    max_items_in_row=2000,
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=250_000,
    max_grammar_size=500_000,
    verbose_errors=False,
)
# Past MAX_ALTERNATIVES properties or anyOf/oneOf branches in one place a schema is refused before the
# library sees it (a bound on compile work and on each step's cost: a 1300-property object, allowed past
# the row bound, took 48 ms per mask on the bench CPU, far beyond a model step's budget).
MAX_ALTERNATIVES = 900
# llguidance's parser holds in one row every property that may come next: an object whose first k
# properties are all optional opens 4k + 7 items (measured with 1.9.1, whatever the properties' types, the
# object's depth, or begin/end texts around it), at most max_items_in_row, or the request fails at the
# object's "{". So at most 498 optional properties may open an object (the first required one ends the
# run). The library's own verdict at the first free token is checked as well (`_probe_opening`).
MAX_OPTIONAL_RUN = (2000 - 7) // 4
# Bytes that can start a token past a JSON schema's forced opening where the parser may open a structure
# (a value, a key, a separator, a closer): each, as a one-byte token, is fed to a copy at compile time.
_PROBE_BYTES = b'{["-0123456789tfn}],:'
STEP_BRANCHES = 8  # alternatives a closing walk compares during a request (Closer.max_branches at compile)
# Closing walks on the engine loop, per request (closing.Fuel steps, tens of microseconds each): a bank it
# starts with and may hold, refilled by each token it takes. Its walks never cost more than the bank plus
# the refill per token, whatever the schema; a request whose walk runs dry is steered no more.
STEP_WALK_FUEL = 8192
STEP_WALK_REFILL = 64
COMPILE_WALK_FUEL = 65536  # the walks at compile time, per grammar: bounded on their own, below the bound
_ROW_ERROR = re.compile(r"Current row has (\d+) items; max is (\d+)")
_ERROR_PREFIX = re.compile(r"^at \d+\(\d+\): ")
_CacheKey = tuple[str, str, str, bool, bool]


class GrammarRefused(InvalidRequest):
    """A structured-output spec refused; `reason` is "schema" (it cannot be enforced: the same answer on
    every try) or "timeout" (its compile passed the time bound: retried once the refusal expires)."""

    def __init__(self, message: str, *, param: str | None, reason: str) -> None:
        super().__init__(message, param=param)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class _Refusal:
    message: str
    reason: str


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe: the engine loop thread alone drives it.

    With a closer (closing.Closer) it also keeps the request's closing: the tokens that would finish
    the output from here. The engine passes each step's token budget: when the closing and the stop token
    need all that is left, the mask allows only the closing's next token (`fill_mask`); and a sampled token
    after which the output could no longer finish in time is taken back for the closing's next one (`take`).
    So an output whose request had at least `CompiledGrammar.min_tokens` always completes.

    A triggered grammar's free text is not steered (it may end anywhere, by length as well): the closing is
    kept from the token that writes the first block's opening on (`free` until then). A block opened with
    too little left to complete is not begun: that token is taken back for the stop token.
    """

    __slots__ = (
        "_block",
        "_closer",
        "_failures",
        "_fuel",
        "_lexical",
        "_matcher",
        "_plan",
        "_skip",
        "_stop",
        "_stop_ids",
        "_terminated",
        "_trigger",
        "_words",
        "steered",
    )

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        stop_ids: frozenset[int],
        words: int,
        closer: Closer | None = None,
        plan: list[int] | None = None,
        trigger: Trigger | None = None,
        block: list[int] | None = None,
    ) -> None:
        self._matcher = matcher
        self._stop_ids = stop_ids
        self._stop = min(stop_ids)
        self._words = words
        self._terminated = False
        self._closer = closer
        self._lexical = Lexical()
        self._plan = plan if closer is not None else None
        self._trigger = trigger if closer is not None else None  # set: free text, before the opening
        self._block = block  # the closing from just after the opening (known at compile time)
        self.steered = False  # the budget forced a closing token at least once
        self._fuel = Fuel(STEP_WALK_FUEL)
        self._failures = 0  # walks that found no closing
        self._skip = 0  # re-plans to pass over before walking again after a failed walk

    def fill_mask(self, bitmask: torch.Tensor, row: int, left: int | None = None) -> None:
        """Write into `bitmask[row]` the tokens allowed next. Only stop tokens once the grammar is complete
        (or after a refused token: the matcher is then dead and the request should end). With `left`, the
        tokens the request may still produce (this one included): only the closing's next token when the
        closing and the stop token need them all."""
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
            raise ValueError("the bitmask must be a contiguous int32 CPU tensor (see new_bitmask)")
        if bitmask.dim() != 2 or bitmask.shape[1] != self._words or not 0 <= row < bitmask.shape[0]:
            raise ValueError(
                f"bitmask of shape {tuple(bitmask.shape)} has no row {row} of {self._words} words"
            )
        target = bitmask[row]
        forced = self.forced_token(left)
        if forced is not None:
            target.zero_()
            target[forced // 32] = _bit(forced % 32)
            self.steered = True
            return
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), self._words * 4)

    def forced_token(self, left: int | None) -> int | None:
        """The closing's next token if, with `left` tokens to go (this one included), the closing and the
        stop token need them all; else None."""
        plan = self._plan
        if left is None or plan is None or self._terminated:
            return None
        return (plan[0] if plan else self._stop) if len(plan) + 1 >= left else None

    def accept(self, token_id: int) -> bool:
        """Advance by the token sampled (every one, the stop token included). False if the grammar refuses
        it; the matcher then stays refused (every later mask allows only the stop tokens)."""
        if self._terminated or not self._matcher.consume_token(token_id):
            return False
        if token_id in self._stop_ids:
            self._terminated = True
        return True

    def take(self, token_id: int, left: int | None) -> int | None:
        """`accept` with a budget: `left` is how many tokens the request may still produce after this one.
        Returns the token taken (the one sampled, or the closing's next one when the sampled one would leave
        the output unable to finish in `left`), None if the grammar refuses it."""
        closer = self._closer
        if closer is not None:
            self._fuel.left = min(STEP_WALK_FUEL, self._fuel.left + STEP_WALK_REFILL)
        if self._trigger is not None and closer is not None:
            return self._take_free(closer, self._trigger, token_id, left)
        if closer is None or left is None or token_id in self._stop_ids:
            return token_id if self.accept(token_id) else None
        plan, lexical = self._plan, self._lexical
        if not self.accept(token_id):
            return None
        self._advance(closer, token_id, plan)
        if self._plan is None or len(self._plan) + 1 <= left or plan is None:
            return token_id  # it fits (or no closing is known to do better)
        # Too long to finish now: the closing known before this token is the way (it fitted then); from a
        # complete match (a repeated block could follow) that is the stop token.
        self._matcher.rollback(1)
        self._lexical = lexical
        self.steered = True
        if not plan:
            self._plan = []
            return self._stop if self.accept(self._stop) else None
        if not self.accept(plan[0]):
            return None
        self._advance(closer, plan[0], plan)
        return plan[0]

    def _take_free(self, closer: Closer, trigger: Trigger, token_id: int, left: int | None) -> int | None:
        """`take` in the free text before a triggered grammar's first block: the token sampled, unless it
        writes the block's opening with too little left for the block to complete; the text then ends
        before that token (the stop token in its place)."""
        if not self.accept(token_id):
            return None
        if token_id in self._stop_ids:
            return token_id
        self._trigger, rest = trigger.after(closer.token_bytes(token_id))
        if rest is None:
            return token_id
        self._trigger, self._lexical = None, Lexical().after(rest)
        known = self._block if not rest else None  # the common case: the token ends with the opening
        if known is not None and self._finishes(known):
            self._plan = list(known)
        else:
            self._plan = self._replan(closer)
        if left is None or self._plan is None or len(self._plan) + 1 <= left:
            return token_id
        self._matcher.rollback(1)
        self._trigger, self._lexical, self._plan = trigger, Lexical(), None
        self.steered = True
        return self._stop if self.accept(self._stop) else None

    def _advance(self, closer: Closer, token_id: int, plan: list[int] | None) -> None:
        """Follow `token_id` (consumed) in the lexical state and the closing. Before walking anew, the
        closing known before is tried: whole (the model writes a string's text, the common case), its rest
        when the token was its first, and its bytes after the token's own when the token wrote them (or, in
        a string, ended it as the closing would)."""
        data = closer.token_bytes(token_id)
        before, self._lexical = self._lexical, self._lexical.after(data)
        if plan is not None:
            rest = plan[1:] if plan and plan[0] == token_id else plan
            if self._finishes(rest):
                self._plan = rest
                return
            written = closer.rest_after(plan, data, before)
            if written is not None and self._finishes(written):
                self._plan = written
                return
        self._plan = self._replan(closer)

    def _replan(self, closer: Closer) -> list[int] | None:
        """A closing walked from here, within the request's fuel. Mid-request, fewer alternatives are
        compared than at compile time (the walk is on the engine loop): a longer closing only steers a
        little earlier. A walk that found none is not redone at the next token: the walks after the k-th
        failure wait 2^k - 1 re-plans. A walk that ran out of fuel ends the steering for good."""
        if self._skip:
            self._skip -= 1
            return None
        plan = closer.closing(self._matcher, self._lexical, branches=STEP_BRANCHES, fuel=self._fuel)
        if self._fuel.spent:
            log.info("a structured output's closing walks spent their fuel: it is steered no more")
            self._closer = None
        elif plan is None:
            self._failures += 1
            self._skip = (1 << min(self._failures, 12)) - 1
        return plan

    def _finishes(self, tokens: list[int]) -> bool:
        """Whether `tokens` take the match from here to complete (the stop token is valid only there)."""
        return bool(self._matcher.validate_tokens([*tokens, self._stop]) == len(tokens) + 1)

    @property
    def closing_tokens(self) -> int | None:
        """Tokens the closing needs from here, the stop token excluded; None when unknown."""
        return None if self._plan is None else len(self._plan)

    @property
    def free(self) -> bool:
        """In a triggered grammar's free text (no block begun): the output may still end anywhere, as an
        unconstrained one would (stop strings included)."""
        return self._trigger is not None

    @property
    def terminated(self) -> bool:
        """A stop token was accepted: the grammar was complete and the output is done."""
        return self._terminated

    @property
    def completed(self) -> bool:
        """The output so far is a whole match: a stop token would be accepted now."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the last token was refused, if one was."""
        return self._matcher.get_error() if self._matcher.is_error() else None


def _bit(index: int) -> int:
    """The int32 word with only bit `index` set (bit 31 is the sign bit)."""
    return (1 << index) - (1 << 32 if index == 31 else 0)


class CompiledGrammar:
    """A compiled spec; immutable and shared by every request with an equal spec (thread-safe).

    `min_tokens`: the fewest output tokens (the stop token included) in which this grammar's closing from
    its start is known to complete; a request with a smaller max_tokens cannot be served (None: unknown, the
    request is then not steered). A triggered grammar's is 1: its free text may end at once.

    `trigger`: a triggered grammar's opening (its `begin`); `opened`, a copy of the template past it, from
    which the closing of a block just begun is walked once, here."""

    __slots__ = (
        "_block",
        "_closer",
        "_opening",
        "_stop_ids",
        "_template",
        "_trigger",
        "_words",
        "min_tokens",
    )

    def __init__(
        self,
        template: llguidance.LLMatcher,
        stop_ids: frozenset[int],
        words: int,
        closer: Closer | None = None,
        trigger: bytes | None = None,
        opened: llguidance.LLMatcher | None = None,
    ) -> None:
        self._template = template  # a matcher at the start, never advanced: each request copies it
        self._stop_ids = stop_ids
        self._words = words
        self._closer = closer
        fuel = Fuel(COMPILE_WALK_FUEL)
        self._opening = closer.closing(template, Lexical(), fuel=fuel) if closer is not None else None
        self.min_tokens = None if self._opening is None else len(self._opening) + 1
        self._trigger = trigger
        self._block = None
        if closer is not None and opened is not None:
            self._block = closer.closing(opened, Lexical(), fuel=fuel)

    def matcher(self) -> GrammarMatcher:
        """A fresh per-request state (a copy of the compiled start state: no compilation)."""
        closer = self._closer if self._opening is not None else None
        plan = list(self._opening) if self._opening is not None else None
        if self._trigger is not None:
            return GrammarMatcher(
                self._template.deep_copy(),
                self._stop_ids,
                self._words,
                closer,
                None,  # nothing to close in free text
                Trigger(self._trigger),
                self._block,
            )
        return GrammarMatcher(self._template.deep_copy(), self._stop_ids, self._words, closer, plan)


class GrammarCompiler:
    """Compiles `StructuredOutput` specs for one tokenizer, and caches grammars and refusals per tenant.

    `vocab_size` is the model's logits width (>= len(tokenizer)); ids past the tokenizer are never allowed.
    `stop_token_ids` are the model's EOS ids: the only tokens allowed once the grammar is complete.
    The cache holds `cache_size` entries, at most `tenant_share` of them per tenant (GrammarCache).
    `compile` blocks (about a millisecond for typical schemas; longer for big ones); it runs on the calling
    thread alone and releases the GIL while llguidance builds the grammar. Construction is cheap: the
    tokenizer is converted for the library on the first compile.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        cache_size: int = 256,
        tenant_share: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            raise ValueError(
                f"structured output needs a fast (Rust) tokenizer, got {type(tokenizer).__name__}"
            )
        if vocab_size < len(tokenizer):
            raise ValueError(
                f"vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)"
            )
        if not stop_token_ids:
            raise ValueError("at least one stop token id is needed")
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._hf_tokenizer = tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None  # converted on the first compile
        self._closer: Closer | None = None  # made with it
        self._probe_tokens: list[int] = []  # one-byte tokens of _PROBE_BYTES
        self._words = (vocab_size + 31) // 32
        share = min(cache_size, 32) if tenant_share is None else tenant_share
        self._cache: GrammarCache[CompiledGrammar | _Refusal] = GrammarCache(cache_size, share, clock=clock)
        self._lock = threading.Lock()
        self._refusals: Counter[str] = Counter()

    @staticmethod
    def key(spec: StructuredOutput) -> _CacheKey:
        """What makes two specs one grammar (`param` only names errors)."""
        return (spec.json_schema, spec.begin, spec.end, spec.repeat, spec.triggered)

    def lookup(self, spec: StructuredOutput, tenant: Tenant = None) -> CompiledGrammar | None:
        """The tenant's cached grammar for `spec`, None if it must be compiled; raises GrammarRefused for a
        cached refusal that has not expired. Cheap: callable from an event loop."""
        found = self._cache.get(tenant, self.key(spec))
        if isinstance(found, _Refusal):
            raise GrammarRefused(found.message, param=spec.param, reason=found.reason)
        return found

    def compile(self, spec: StructuredOutput, tenant: Tenant = None) -> CompiledGrammar:
        """The compiled grammar for `spec`; raises GrammarRefused (naming `spec.param`) for a schema that is
        not valid JSON / JSON Schema, uses a keyword the library cannot enforce, passes a work limit, or
        is refused (not yet expired) after passing the time bound."""
        found = self.lookup(spec, tenant)
        if found is None:
            built = self._build(spec)
            stored = self._cache.put(tenant, self.key(spec), built)  # two threads may build one spec
            if isinstance(stored, _Refusal):
                raise GrammarRefused(stored.message, param=spec.param, reason=stored.reason)
            found = stored
        return found

    def refuse(self, spec: StructuredOutput, tenant: Tenant, message: str, *, ttl_s: float) -> None:
        """Refuse `spec` for this tenant for `ttl_s` (its compile passed the time bound): a request for it
        meanwhile is refused at once, and a compile of it still running is dropped when it ends."""
        self._cache.put(tenant, self.key(spec), _Refusal(message, "timeout"), ttl_s=ttl_s)

    def count_refusal(self, reason: str) -> None:
        """Count one request refused: "schema", "timeout", or "busy" (no grammar thread in time)."""
        with self._lock:
            self._refusals[reason] += 1

    def refusals(self) -> dict[str, int]:
        """Requests refused since start, by reason."""
        with self._lock:
            return dict(self._refusals)

    def cache_len(self) -> int:
        return len(self._cache)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                converted = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=list(self.stop_token_ids)
                )
                one_byte = (converted.tokenize_bytes(bytes([b])) for b in _PROBE_BYTES)
                self._probe_tokens = [ids[0] for ids in one_byte if len(ids) == 1]
                self._tokenizer = converted
                self._closer = Closer(converted)
            return self._tokenizer

    def _build(self, spec: StructuredOutput) -> CompiledGrammar | _Refusal:
        try:
            lark = _lark(spec)
        except ValueError as error:
            return _Refusal(_message(str(error)), "schema")
        tokenizer = self._llg_tokenizer()
        template = llguidance.LLMatcher(tokenizer, lark, log_level=0, limits=_LIMITS)
        opened = None
        if spec.triggered and not template.is_error():
            # Free text is no schema's business: the schema's opening is probed just past `begin`.
            opened = template.deep_copy()
            opened.consume_tokens(tokenizer.tokenize_str(spec.begin))
        start = opened if opened is not None else template
        failure = start.get_error() if start.is_error() else self._probe_opening(start)
        if failure is not None:
            return _Refusal(_message("the JSON schema cannot be enforced: " + _reason(failure)), "schema")
        closer = self._closer if Closer.supports(spec.begin, spec.end) else None
        if spec.triggered and closer is None:  # its free text's end could not be found: never asked for
            return _Refusal(_message("a triggered grammar's begin and end cannot hold quotes"), "schema")
        trigger = spec.begin.encode() if spec.triggered else None
        return CompiledGrammar(template, frozenset(self.stop_token_ids), self._words, closer, trigger, opened)

    def _probe_opening(self, template: llguidance.LLMatcher) -> str | None:
        """Why the grammar would fail a request at its first free token, if it would: a copy takes the
        forced opening (the begin text, "{", required keys...), then each probe byte the mask allows there
        as a token of its own, and computes the next mask. A token longer than one byte starts with one of
        these, so it meets the same parser row; a row or step over the library's limits fails here, at
        compile time, instead of at a request's first token."""
        opening = template.deep_copy()
        forced = opening.compute_ff_tokens()
        if forced:
            opening.consume_tokens(forced)
        if opening.is_error():
            return opening.get_error()
        mask = opening.compute_bitmask()
        for token in self._probe_tokens:
            if not mask[token // 8] >> (token % 8) & 1:
                continue
            trial = opening.deep_copy()
            if trial.consume_token(token):
                trial.compute_bitmask()
            if trial.is_error():
                return trial.get_error()
        return None


def _lark(spec: StructuredOutput) -> str:
    try:
        schema = json.loads(spec.json_schema)
    except json.JSONDecodeError as error:
        raise ValueError(f"the JSON schema is not valid JSON: {error}") from None
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise ValueError(f"the JSON schema must be an object (or true), got {json.dumps(schema)[:40]}")
    _check_width(schema)
    schema = {**schema, "x-guidance": _JSON_OPTIONS}  # the request's own "x-guidance", if any, is dropped
    # Lark string literals as JSON strings (the same escapes); nothing but them goes between JSON tokens.
    block = " ".join(
        [*([json.dumps(spec.begin, ensure_ascii=False)] if spec.begin else []), "json"]
        + ([json.dumps(spec.end, ensure_ascii=False)] if spec.end else [])
    )
    rules = [
        'start: block ("\\n" block)*' if spec.repeat else "start: block",
        f"block: {block}",
        f"json: %json {json.dumps(schema, ensure_ascii=False)}",
    ]
    if spec.triggered:  # text alone, or text up to the first begin (lazy: it ends there) and the blocks
        begin, end = json.dumps(spec.begin, ensure_ascii=False), json.dumps(spec.end, ensure_ascii=False)
        rules[:2] = [
            'start: TEXT | opened ("\\n" block)*' if spec.repeat else "start: TEXT | opened",
            f"opened: head json {end}",
            f"head[lazy]: TEXT {begin}",
            f"TEXT: ~(/(?s:.*)/ {begin} /(?s:.*)/)",
            f"block: {block}",
        ]
    return "\n".join(rules) + "\n"


def _check_width(node: Any) -> None:
    """Raise for an object with more than MAX_ALTERNATIVES properties or a longer anyOf/oneOf, or with more
    than MAX_OPTIONAL_RUN optional properties before its first required one, anywhere."""
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            for keyword in ("properties", "anyOf", "oneOf"):
                value = node.get(keyword)
                if isinstance(value, dict | list) and len(value) > MAX_ALTERNATIVES:
                    raise ValueError(
                        f"the JSON schema has {len(value)} {keyword} in one place; at most {MAX_ALTERNATIVES}"
                        " are supported"
                    )
            run = _optional_run(node)
            if run > MAX_OPTIONAL_RUN:
                raise ValueError(
                    f"the JSON schema has an object whose first {run} properties are optional; at most "
                    f"{MAX_OPTIONAL_RUN} may be (make an earlier one required, or use fewer)"
                )
            stack.extend(node.values())


def _optional_run(node: dict[str, Any]) -> int:
    """How many optional properties may each come first in this object (properties keep schema order)."""
    properties = node.get("properties")
    if not isinstance(properties, dict):
        return 0
    required = node.get("required")
    names = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
    for i, name in enumerate(properties):
        if name in names:
            return i
    return len(properties)


def _reason(error: str) -> str:
    """llguidance's message without its position prefix and the grammar source it echoes; its parser-row
    bound in the schema's own terms."""
    row = _ROW_ERROR.search(error)
    if row is not None:
        return (
            f"it opens {row[1]} alternatives at once where at most {row[2]} are supported (each optional "
            "property or anyOf branch that may come next is one): make some properties required, or use fewer"
        )
    text = _ERROR_PREFIX.sub("", error.split("\n   1 | ", 1)[0])
    return " ".join(text.split())


def _message(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 [rows, ceil(vocab_size / 32)] CPU bitmask with every token allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place on CPU float [rows, V] logits: every token whose bit is 0 becomes -inf, and so does every
    column past the bitmask's 32 * words (model padding beyond what the mask covers)."""
    if logits.device.type != "cpu" or bitmask.device.type != "cpu":
        raise ValueError("apply_bitmask works on CPU tensors")
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)} do not match")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"the bitmask must be int32, got {bitmask.dtype}")
    width = logits.shape[1]
    covered = min(width, bitmask.shape[1] * 32)
    # Little-endian int32 words as bytes, bits unpacked least-significant first: bit i of word j is column
    # 32 * j + i (the layout both grammar libraries write).
    words = np.ascontiguousarray(bitmask.numpy(), dtype="<i4")  # a copy only on a big-endian host
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits[:, :covered].view(np.bool_))
    if covered < width:
        logits[:, covered:] = float("-inf")
    logits[:, :covered].masked_fill_(~allowed, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """bool [rows, width] on the bitmask's device: bit i of word j allows column 32 * j + i (the layout the
    grammar library writes); columns past the mask's 32 * words are not allowed (model padding)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [rows, words, 32]
    allowed = bits.reshape(bitmask.shape[0], -1).bool()  # [rows, 32 * words]
    if allowed.shape[1] >= width:
        return allowed[:, :width]
    pad = torch.zeros(bitmask.shape[0], width - allowed.shape[1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)
