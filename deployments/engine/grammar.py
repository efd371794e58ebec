"""Grammar-constrained decoding: a `StructuredOutput` becomes a token mask per step, one row per request.

The only engine module that imports the grammar library, llguidance (chosen by bench/grammar_libraries.py;
see docs/decisions.md): it rejects the JSON Schema keywords it cannot enforce instead of ignoring them,
and every output decoded under its mask validated. The output is compact JSON (no whitespace between
JSON tokens, "," and ":" separators), optionally as begin + JSON + end, and with `repeat` one or more such
blocks separated by "\\n". Once the grammar is complete, only the stop (EOS) tokens are allowed.

Use: `GrammarCompiler.compile(spec)` (blocking, thread-safe, cached) off the engine loop thread; per
request `compiled.matcher()`; per step `matcher.fill_mask(bitmask, row)` into a `new_bitmask(rows, V)`,
`apply_bitmask(logits, bitmask)`, then `matcher.accept(token)` for the token sampled.
Bitmask layout (llguidance's and xgrammar's): int32 words, bit i of word j allows token 32 * j + i.
"""

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from deployments.engine.errors import InvalidRequest
from deployments.engine.sampling_params import StructuredOutput

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
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)  # errors must not echo parser state or grammar
# llguidance's parser holds every optional property (and anyOf branch) of an object in one row, at most 2000
# items by default (a bound on each step's cost): past ~1000 a request would fail at its first token. Such
# schemas are refused when compiled instead. (A 1300-property object, allowed past the bound, took 48 ms
# per mask on the bench CPU: far beyond a model step's budget.)
MAX_ALTERNATIVES = 900
_ERROR_PREFIX = re.compile(r"^at \d+\(\d+\): ")
_CacheKey = tuple[str, str, str, bool]


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe: the engine loop thread alone drives it."""

    __slots__ = ("_matcher", "_stop_ids", "_terminated", "_words")

    def __init__(self, matcher: llguidance.LLMatcher, stop_ids: frozenset[int], words: int) -> None:
        self._matcher = matcher
        self._stop_ids = stop_ids
        self._words = words
        self._terminated = False

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write into `bitmask[row]` the tokens allowed next. Only stop tokens once the grammar is complete
        (or after a refused token: the matcher is then dead and the request should end)."""
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
            raise ValueError("the bitmask must be a contiguous int32 CPU tensor (see new_bitmask)")
        if bitmask.dim() != 2 or bitmask.shape[1] != self._words or not 0 <= row < bitmask.shape[0]:
            raise ValueError(
                f"bitmask of shape {tuple(bitmask.shape)} has no row {row} of {self._words} words"
            )
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), self._words * 4)

    def accept(self, token_id: int) -> bool:
        """Advance by the token sampled (every one, the stop token included). False if the grammar refuses
        it; the matcher then stays refused (every later mask allows only the stop tokens)."""
        if self._terminated or not self._matcher.consume_token(token_id):
            return False
        if token_id in self._stop_ids:
            self._terminated = True
        return True

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


class CompiledGrammar:
    """A compiled spec; immutable and shared by every request with an equal spec (thread-safe)."""

    __slots__ = ("_stop_ids", "_template", "_words")

    def __init__(self, template: llguidance.LLMatcher, stop_ids: frozenset[int], words: int) -> None:
        self._template = template  # a matcher at the start, never advanced: each request copies it
        self._stop_ids = stop_ids
        self._words = words

    def matcher(self) -> GrammarMatcher:
        """A fresh per-request state (a copy of the compiled start state: no compilation)."""
        return GrammarMatcher(self._template.deep_copy(), self._stop_ids, self._words)


class GrammarCompiler:
    """Compiles `StructuredOutput` specs for one tokenizer, caching the last `cache_size` of them (LRU).

    `vocab_size` is the model's logits width (>= len(tokenizer)); ids past the tokenizer are never allowed.
    `stop_token_ids` are the model's EOS ids: the only tokens allowed once the grammar is complete.
    `compile` blocks (about a millisecond for typical schemas; longer for big ones); it runs on the calling
    thread alone and releases the GIL while llguidance builds the grammar.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        cache_size: int = 256,
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
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(self.stop_token_ids)
        )
        self._words = (vocab_size + 31) // 32
        self._cache_size = cache_size
        self._cache: OrderedDict[_CacheKey, CompiledGrammar | str] = OrderedDict()  # str: the error
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar for `spec`; raises InvalidRequest (naming `spec.param`) for a schema that is
        not valid JSON / JSON Schema, or one using a keyword the library cannot enforce."""
        key = (spec.json_schema, spec.begin, spec.end, spec.repeat)  # `param` only names errors
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
        if found is None:
            found = self._build(spec)
            with self._lock:  # two threads may have built the same spec: the first stored wins
                found = self._cache.setdefault(key, found)
                self._cache.move_to_end(key)
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(found, str):
            raise InvalidRequest(found, param=spec.param)
        return found

    def cache_len(self) -> int:
        with self._lock:
            return len(self._cache)

    def _build(self, spec: StructuredOutput) -> CompiledGrammar | str:
        try:
            lark = _lark(spec)
        except ValueError as error:
            return _message(str(error))
        template = llguidance.LLMatcher(self._tokenizer, lark, log_level=0, limits=_LIMITS)
        if template.is_error():
            return _message("the JSON schema cannot be enforced: " + _reason(template.get_error()))
        return CompiledGrammar(template, frozenset(self.stop_token_ids), self._words)


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
    return "\n".join(rules) + "\n"


def _check_width(node: Any) -> None:
    """Raise for an object with more than MAX_ALTERNATIVES properties or a longer anyOf/oneOf, anywhere."""
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
            stack.extend(node.values())


def _reason(error: str) -> str:
    """llguidance's message without its position prefix and the grammar source it echoes."""
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
