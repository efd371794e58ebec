"""Incremental detokenization for streaming, with stop strings (OpenAI semantics).

Each step decodes only a short window of recent token ids (vLLM's prefix_offset/read_offset
technique): text is released once the window's decoded text grows and does not end in U+FFFD, so a
character split across byte-level tokens is never emitted half-done. Stop strings truncate the
output before the match; text that could still become the start of a stop string is held back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# Prompt tokens that seed the window: decoders whose output depends on neighbours (SentencePiece
# drops the first token's leading space) need context for the first output tokens to decode right.
_CONTEXT_TOKENS = 6
# Once the window holds this many tokens it restarts; between restarts the window's text of one
# step is the next step's prefix text, so a step costs one decode. A decode costs about a call plus a
# quarter of one per window token: windows of up to 8 (a restart's extra decode included) cost ~40% less a
# token than windows of up to 32, and restarts are at character boundaries, so the text is the same.
_MAX_WINDOW = 8
_INCOMPLETE = "\ufffd"  # what a partial UTF-8 sequence decodes to


@dataclass(slots=True)
class DetokenizerDelta:
    text: str  # new text safe to emit now (may be "")
    stop_reason: str | int | None  # the stop string that ended generation, or None


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas, one token at a time.

    Without a stop string hit, the deltas plus finish() equal decoding the output ids in one go
    (`skip_special_tokens` as given, no clean-up of tokenization spaces). For decoders that depend
    on context, the first tokens decode as a continuation of the prompt: a SentencePiece "▁Paris"
    after a prompt streams " Paris", as vLLM does, where decoding the output alone gives "Paris".
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int],
        *,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._backend_decode = backend_decode(tokenizer)
        self._stop = tuple(stop)
        self._stop_starts = frozenset(s[0] for s in self._stop)
        self._max_hold = max((len(s) for s in self._stop), default=1) - 1

        context, context_text = self._context(prompt_ids)
        self._ids = context  # window ids, then every output id
        self._prefix_offset = 0  # the window starts here
        self._read_offset = len(context)  # ids before this have been turned into text
        self._prefix_text = context_text  # decode(ids[prefix_offset:read_offset])
        self._held = ""  # decoded text not yet emitted: it could be the start of a stop string
        self._emitted: list[str] = []
        self._stop_reason: str | None = None
        self._done = False
        # vLLM's min_tokens: stop strings count only in text decoded once this many tokens were added
        self._unchecked_tokens = min_tokens

    @property
    def output_text(self) -> str:
        """Everything emitted so far (truncated before the stop string, if one was hit)."""
        return "".join(self._emitted)

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended generation (from add_token or finish), or None."""
        return self._stop_reason

    @property
    def has_stops(self) -> bool:
        return bool(self._stop)

    def drop_stops(self) -> None:
        """From the next token on no stop string counts (a structured part of the output has begun, which
        none may cut); text held back for one comes out with the next delta."""
        self._stop, self._stop_starts, self._max_hold = (), frozenset(), 0

    def add_token(self, token_id: int) -> DetokenizerDelta:
        if self._done:
            return DetokenizerDelta("", self._stop_reason)
        self._ids.append(token_id)
        self._unchecked_tokens -= 1
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(self._prefix_text):
            return DetokenizerDelta("", None)  # e.g. a skipped special token
        new = text[len(self._prefix_text) :]
        if text.endswith(_INCOMPLETE):
            # Wait for the character's remaining bytes. The complete text before it can already
            # finish a stop string: catch that now rather than one token late.
            return self._release(new.rstrip(_INCOMPLETE), commit=False)
        if len(self._ids) - self._prefix_offset >= _MAX_WINDOW:
            # Restart at the previous read offset: a character boundary, which byte-fallback
            # decoders need (they decode runs of byte tokens as one group).
            self._prefix_offset = self._read_offset
            self._prefix_text = self._decode(self._ids[self._prefix_offset :])
        else:
            self._prefix_text = text
        self._read_offset = len(self._ids)
        return self._release(new, commit=True)

    def finish(self) -> str:
        """Flushes the held-back text; call when generation ends for any reason but a stop string.

        The flushed text can still contain a stop string (one completed by the final tokens while a
        character was incomplete); it is then truncated and stop_reason set.
        """
        if self._done:
            return ""
        text = self._decode(self._ids[self._prefix_offset :])[len(self._prefix_text) :]
        delta = self._release(text, commit=True, final=True)
        return delta.text

    def _release(self, new: str, *, commit: bool, final: bool = False) -> DetokenizerDelta:
        """Appends decoded text and emits what cannot be part of a stop string.

        commit=False: `new` is only looked at for a stop string; otherwise it is decoded again later.
        """
        if not self._stop:  # nothing to look for or hold back (the common case: one branch per token)
            if not commit:
                return DetokenizerDelta("", None)
            text, self._held, self._done = self._held + new, "", final
            return self._emit(text, None)
        text = self._held + new
        hit = self._first_stop(text) if self._unchecked_tokens < 0 else None
        if hit is not None:
            at, stop = hit
            self._done = True
            self._stop_reason = stop
            self._held = ""
            return self._emit(text[:at], stop)
        if not commit:
            return DetokenizerDelta("", None)
        keep = 0 if final or self._unchecked_tokens >= 0 else self._stop_prefix_len(text)
        self._held = text[len(text) - keep :]
        self._done = final
        return self._emit(text[: len(text) - keep], None)

    def _emit(self, text: str, stop: str | None) -> DetokenizerDelta:
        if text:
            self._emitted.append(text)
        return DetokenizerDelta(text, stop)

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop) of the stop string occurrence that ends first in text, or None.

        Ending first, not starting first: that is the one a character-by-character stream meets
        first, so the result does not depend on how the text was split into tokens. On equal ends
        the longer (earlier-starting) one wins, so no character of it is emitted.
        """
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            at = text.find(stop)
            if at >= 0 and (best is None or (at + len(stop), at) < best[:2]):
                best = (at + len(stop), at, stop)
        return None if best is None else (best[1], best[2])

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        for i in range(max(0, len(text) - self._max_hold), len(text)):
            if text[i] in self._stop_starts:
                tail = text[i:]
                if any(stop.startswith(tail) for stop in self._stop):
                    return len(text) - i
        return 0

    def _context(self, prompt_ids: Sequence[int]) -> tuple[list[int], str]:
        """The prompt's last few ids, starting and ending on a character boundary, and their text."""
        n = len(prompt_ids)
        for k in range(min(n, _CONTEXT_TOKENS), min(n, 2 * _CONTEXT_TOKENS) + 1):
            ids = list(prompt_ids[n - k :])
            text = self._decode(ids)
            # A leading U+FFFD: the window starts inside a character; a byte-fallback decoder
            # would turn the output's bytes that follow into U+FFFD too. Reach further back.
            if not text.startswith(_INCOMPLETE):
                break
        else:
            return [], ""
        if text.endswith(_INCOMPLETE):
            return [], ""  # the prompt ends inside a character: context would fuse with the output
        return ids, text

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, self._skip_special_tokens)
        # No clean-up: it rewrites text across window boundaries (" ." -> "."), so windows would
        # disagree with each other.
        text = self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )
        if not isinstance(text, str):
            raise TypeError(f"tokenizer.decode returned {type(text).__name__}, expected str")
        return text


def backend_decode(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int], bool], str] | None:
    """The Rust tokenizer's own decode, where transformers' `decode` of a list of ids without clean-up is
    exactly that call (a fast tokenizer that overrides neither `decode` nor `_decode`), else None. The
    wrapper's input conversion costs ~10 us a call, twice the Rust decode of a whole window: the engine
    decodes a window per sequence per step."""
    kind = type(tokenizer)
    fast = isinstance(tokenizer, PreTrainedTokenizerFast)
    if (
        not fast
        or kind.decode is not PreTrainedTokenizerBase.decode
        or kind._decode is not PreTrainedTokenizerFast._decode
    ):
        return None
    decode: Callable[[list[int], bool], str] = tokenizer.backend_tokenizer.decode
    return decode
