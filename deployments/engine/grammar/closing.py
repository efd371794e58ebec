"""Closer: the shortest way found to finish a structured output from where its grammar stands.

llguidance answers "which tokens may come next" and "which bytes are now forced", not "how many tokens are
still needed to finish". So this walks a copy of the request's matcher byte by byte: it takes the bytes the
grammar forces (`compute_ff_bytes`), and where the grammar branches, the first byte of a fixed preference
order that the grammar allows (each checked with `validate_tokens` on the byte's one-byte token), until the
grammar accepts. The order is JSON's way to stop soonest: inside a string, its closing quote (then a filler
character, for a minLength or a pattern); outside, a closer ("}", "]"), the separator to a required member,
then the shortest values ("0", '""', "true", "null", "[]", "{}"). The grammar itself keeps the walk valid:
llguidance only allows bytes that can still complete the match, so required members, enums, patterns,
minItems and number bounds are all honoured, by construction.

Where the order has no answer (the first character of an enum value or of a property name), the first few
allowed bytes are each followed to their end and the shortest kept, within a bound (`max_branches`) per
walk; past it the first is taken. So the walk's completion is always valid but may be longer than the true
shortest for some schemas (an anyOf whose first allowed byte starts the longer branch). It is bounded
(`max_bytes`), and so is its work (`Fuel`, walk steps): past either the closing is unknown (None) and the
request is not steered. A byte the order keeps choosing inside a string without the string being able to
end (a pattern like `a*b`, or `[B-G]*~`) is taken at most `_LOOP` times in a row (and a string gets at most
4 * `_LOOP` chosen bytes, for cycles like `(ab)*c`); then the bytes the mask allows are taken round from
the last one, so such patterns close in a few bytes instead of running the walk to its bound at every
token. The bytes become tokens with the model's tokenizer, checked
against the grammar once.

The walk needs to know whether the output stands inside a JSON string (where "}" is text, not a closer):
`Lexical` follows the quotes and escapes of the bytes produced so far. That is only sound when the begin and
end texts around the JSON hold no quote or backslash (the tool-call tags do not); `Closer.supports` says so.
Free text before a triggered grammar's first block is not followed (its quotes are text): `Trigger` watches
it for the block's opening, and `Lexical` starts fresh there.
"""

from dataclasses import dataclass

import llguidance

# Outside a string: closers, then the separator towards a required member, then the shortest values.
_OUTSIDE = b'}],0"tnf[{-123456789.:'
# Inside a string: the closing quote, then fillers for a minLength (any pattern falls back to the mask).
_INSIDE = b'"a0A'
_QUOTE, _BACKSLASH = 0x22, 0x5C
_MAX_CHOICES = 6  # alternatives compared where only the mask tells (the rest: the first is taken)
_LOOP = 4  # the same chosen byte this many times in a row inside a string: try the next allowed byte


class Fuel:
    """Walk steps a caller may still spend on closings (one per byte followed, one per alternative tried):
    the bound on host work a walk costs, shared by all the walks it is passed to. `spent` is set when a walk
    ran out (its closing is then unknown)."""

    __slots__ = ("left", "spent")

    def __init__(self, steps: int) -> None:
        self.left = steps
        self.spent = False

    def take(self) -> bool:
        """One step; False (and `spent`) when none is left."""
        if self.left <= 0:
            self.spent = True
            return False
        self.left -= 1
        return True


@dataclass(frozen=True, slots=True)
class Lexical:
    """Whether the bytes so far leave the output inside a JSON string (and just after a backslash there)."""

    in_string: bool = False
    escaped: bool = False

    def after(self, data: bytes) -> "Lexical":
        in_string, escaped = self.in_string, self.escaped
        for byte in data:
            if escaped:
                escaped = False
            elif in_string and byte == _BACKSLASH:
                escaped = True
            elif byte == _QUOTE:
                in_string = not in_string
        return Lexical(in_string, escaped)


@dataclass(frozen=True, slots=True)
class Trigger:
    """Free text's watch for the opening of a triggered grammar's first block (tool_choice "auto"). The
    grammar commits to the block at the opening's first occurrence, and so does this: `after` returns the
    bytes that follow it (the block's first bytes) once it is written, None before. `held` is the text's last
    len(opening) - 1 bytes: an opening split across tokens begins there."""

    opening: bytes
    held: bytes = b""

    def after(self, data: bytes) -> "tuple[Trigger, bytes | None]":
        window = self.held + data
        at = window.find(self.opening)
        if at >= 0:
            return self, window[at + len(self.opening) :]
        return Trigger(self.opening, window[max(0, len(window) - len(self.opening) + 1) :]), None


class Closer:
    """Finds closings for one tokenizer's grammars. Immutable after construction: shared across threads;
    each call works on its own copy of the matcher."""

    def __init__(
        self, tokenizer: llguidance.LLTokenizer, *, max_bytes: int = 4096, max_branches: int = 64
    ) -> None:
        self._tokenizer = tokenizer
        self.max_bytes = max_bytes
        self.max_branches = max_branches
        # byte -> its one-byte token (a byte-level tokenizer has all 256; a byte without one is never tried)
        singles = (tokenizer.tokenize_bytes(bytes([b])) for b in range(256))
        self._byte_token: list[int | None] = [ids[0] if len(ids) == 1 else None for ids in singles]

    @staticmethod
    def supports(begin: str, end: str) -> bool:
        """Whether `Lexical` reads outputs with these begin/end texts right (no quote or backslash)."""
        return not any(c in text for text in (begin, end) for c in '"\\')

    def token_bytes(self, token: int) -> bytes:
        return self._tokenizer.decode_bytes([token])

    def rest_after(self, plan: list[int], data: bytes, lexical: Lexical) -> list[int] | None:
        """What remains of a closing (`plan`, from where `lexical` stood) after a token of bytes `data`,
        when the token wrote the closing's first bytes: from its start, or, in a string, from the quote
        that ended it (its earlier bytes were the string's text). None otherwise."""
        closing = self._tokenizer.decode_bytes(plan)
        start = 0
        if lexical.in_string:
            start = _string_end(data, lexical)
            if start < 0:
                return None
        written = data[start:]
        if not closing.startswith(written):
            return None
        return self._tokenizer.tokenize_bytes(closing[len(written) :])

    def closing(
        self,
        matcher: llguidance.LLMatcher,
        lexical: Lexical,
        *,
        branches: int | None = None,
        fuel: Fuel | None = None,
    ) -> list[int] | None:
        """Tokens that take `matcher` (not changed) to a complete match, stop token excluded: [] when it is
        complete already; None when no closing was found within max_bytes and the `fuel` given (or the
        matcher failed). `branches` bounds the alternatives compared (default max_branches): fewer cost
        less, and may find a longer closing. Without `fuel`, a walk may take max_bytes steps per branch."""
        if matcher.is_error():
            return None
        if matcher.is_accepting():
            return []
        bound = self.max_branches if branches is None else branches
        if fuel is None:
            fuel = Fuel(self.max_bytes * (bound + 1))
        found = self._walk(matcher.deep_copy(), lexical, [bound], self.max_bytes, fuel)
        if found is None:
            return None
        plan = self._tokenizer.tokenize_bytes(found)
        if matcher.validate_tokens(plan) == len(plan):
            return plan
        # The tokenizer split the bytes in a way the grammar refuses (it should not): one token a byte.
        single = [self._byte_token[b] for b in found]
        return [t for t in single if t is not None] if None not in single else None

    def _walk(
        self, walk: llguidance.LLMatcher, lexical: Lexical, branches: list[int], limit: int, fuel: Fuel
    ) -> bytes | None:
        """The closing's bytes from `walk` (advanced): forced bytes as they come, the preferred byte where
        the order has one; where only the mask tells (an enum's values, a property name to choose), each of
        the first few allowed bytes is followed to its end and the shortest kept, while `branches` (shared
        by the whole walk) lasts."""
        out = bytearray()
        # In the current string: the byte last chosen, how many times in a row, how many bytes chosen.
        last, repeats, chosen = -1, 0, 0
        while not walk.is_accepting():
            if not fuel.take():
                return None
            forced = walk.compute_ff_bytes()
            if forced:
                if not self._consume(walk, forced):
                    return None
                out += forced
                lexical = lexical.after(forced)
            else:
                choices = self._choices(walk, lexical)
                if not choices:
                    return None
                if not lexical.in_string:
                    repeats = chosen = 0
                elif (repeats >= _LOOP or chosen >= 4 * _LOOP) and choices != [_QUOTE]:
                    # The string does not end by repeating what the order chose (one byte, or a cycle
                    # such as "abab" for `(ab)*c`): go round the allowed bytes instead.
                    choices, chosen = [self._next_allowed(walk, last)], 4 * _LOOP  # for the string's rest
                if len(choices) > 1 and branches[0] >= len(choices):
                    branches[0] -= len(choices)
                    best: bytes | None = None
                    for byte in choices:
                        if not fuel.take():
                            break  # out of fuel: the shortest found so far, if any
                        trial = walk.deep_copy()
                        step = bytes([byte])
                        if not self._consume(trial, step):
                            continue
                        rest = self._walk(trial, lexical.after(step), branches, limit - len(out) - 1, fuel)
                        if rest is not None and (best is None or len(rest) + 1 < len(best)):
                            best = step + rest
                    return None if best is None else bytes(out) + best
                step = bytes(choices[:1])
                if not self._consume(walk, step):
                    return None
                repeats = repeats + 1 if choices[0] == last else 1
                last, chosen = choices[0], chosen + 1
                out += step
                lexical = lexical.after(step)
            if len(out) > limit:
                return None
        return bytes(out)

    def _consume(self, walk: llguidance.LLMatcher, data: bytes) -> bool:
        tokens = [self._byte_token[b] for b in data]
        return None not in tokens and walk.consume_tokens([t for t in tokens if t is not None])

    def _choices(self, walk: llguidance.LLMatcher, lexical: Lexical) -> list[int]:
        """The byte to take next: the first of the order that the grammar allows; else the first few bytes
        the mask allows (an enum's or a pattern's first character, a property name, a UTF-8 continuation
        byte), to be compared."""
        order = _INSIDE if lexical.in_string else _OUTSIDE  # after a backslash, '"' is an escape
        for byte in order:
            token = self._byte_token[byte]
            if token is not None and walk.validate_tokens([token]) == 1:
                return [byte]
        return _allowed(walk.compute_bitmask(), self._byte_token)[:_MAX_CHOICES]

    def _next_allowed(self, walk: llguidance.LLMatcher, byte: int) -> int:
        """The first byte the mask allows after `byte`, round from the lowest (`byte` if it is alone)."""
        allowed = _allowed(walk.compute_bitmask(), self._byte_token)
        return next((b for b in allowed if b > byte), allowed[0] if allowed else byte)


def _allowed(mask: object, byte_token: list[int | None]) -> list[int]:
    return [
        byte
        for byte, token in enumerate(byte_token)
        if token is not None and mask[token // 8] >> (token % 8) & 1  # type: ignore[index]
    ]


def _string_end(data: bytes, lexical: Lexical) -> int:
    """Where in `data` (read from inside a string, in state `lexical`) the string's closing quote is; -1
    if it is not in `data`."""
    escaped = lexical.escaped
    for i, byte in enumerate(data):
        if escaped:
            escaped = False
        elif byte == _BACKSLASH:
            escaped = True
        elif byte == _QUOTE:
            return i
    return -1
