"""Log-probabilities in OpenAI's two shapes, from the engine's TokenLogprobs and the base tokenizer.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`; completions: `{"tokens",
"token_logprobs", "top_logprobs", "text_offset"}` (the first prompt token of an echo has no logprob).
A token's string is its text; a token that holds part of a UTF-8 character is written `bytes:\\xNN...`
(as OpenAI does), its `bytes` always exact. Only built when a request asks for logprobs.
"""

import codecs
import math
from collections.abc import Sequence

from app.schemas.openai import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from app.served_models.token_texts import TokenTexts
from deployments.engine.interface import TokenLogprob

FLOOR = -9999.0  # JSON has no -inf: a token with no probability at all gets this (as vLLM)


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> ChatLogprobs:
    content = []
    for entry in entries:
        text, raw = texts.get(entry.token_id)
        top = []
        for token_id, logprob in entry.top:
            top_text, top_raw = texts.get(token_id)
            top.append(TopLogprob(token=top_text, logprob=_value(logprob), bytes=list(top_raw)))
        content.append(
            ChatTokenLogprob(token=text, logprob=_value(entry.logprob), bytes=list(raw), top_logprobs=top)
        )
    return ChatLogprobs(content=content)


class CompletionLogprobsBuilder:
    """One choice's completions logprobs, piece by piece (a stream sends each piece with its text);
    text_offset counts characters from the start of the choice's text."""

    def __init__(self, texts: TokenTexts) -> None:
        self._texts = texts
        self._offset = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None]) -> CompletionLogprobs:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, entry in zip(token_ids, entries, strict=True):
            text, raw = self._texts.get(token_id)
            tokens.append(text)
            offsets.append(self._offset)
            self._offset += len(self._decoder.decode(raw))
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(_value(entry.logprob))
            top: dict[str, float] = {}
            for top_id, logprob in entry.top:
                top.setdefault(self._texts.get(top_id)[0], _value(logprob))
            top_logprobs.append(top)
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=offsets
        )


def join(pieces: Sequence[CompletionLogprobs]) -> CompletionLogprobs:
    joined = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    assert joined.top_logprobs is not None
    for piece in pieces:
        joined.tokens += piece.tokens
        joined.token_logprobs += piece.token_logprobs
        joined.top_logprobs += piece.top_logprobs or []
        joined.text_offset += piece.text_offset
    return joined
