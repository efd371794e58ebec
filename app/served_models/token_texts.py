"""TokenTexts: each token id's text and bytes for one tokenizer, as log-probabilities show them.

A token's string is its text; a token that holds part of a UTF-8 character is written `bytes:\\xNN...`
(as OpenAI does), its `bytes` always exact.
"""

from functools import lru_cache

from tokenizers import decoders
from transformers import PreTrainedTokenizerBase


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> printable character table (GPT-2's bytes_to_unicode)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


def _is_byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = None if backend is None else backend.decoder
    if isinstance(decoder, decoders.ByteLevel):
        return True
    return isinstance(decoder, decoders.Sequence) and "ByteLevel" in repr(decoder)


class TokenTexts:
    """Token id -> (string, bytes) for one tokenizer, cached."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._compute(token_id)
        return found

    def _compute(self, token_id: int) -> tuple[str, bytes]:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):  # out of the tokenizer's range (a model row past its vocabulary)
            return "", b""
        table = _unicode_to_byte()
        if self._byte_level and all(c in table for c in piece):
            raw = bytes(table[c] for c in piece)
        elif self._byte_level:  # an added token, kept as written
            raw = piece.encode()
        else:
            raw = str(self._tokenizer.decode([token_id])).encode()
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw
