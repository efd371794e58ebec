"""API keys: format, hashing and verification. Keys are shown once and stored only as a keyed hash.

Format: `sk-lp-<prefix>_<secret>`: the 12-character prefix is public (it names the key in listings and
is the lookup index); the 43-character secret carries 256 bits. The stored hash is HMAC-SHA256 keyed with
a server secret, so a leaked database alone does not allow offline guessing.
"""

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

KEY_PREFIX = "sk-lp-"
_KEY_RE = re.compile(r"^sk-lp-([A-Za-z0-9]{12})_([A-Za-z0-9_-]{43})$")
_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


@dataclass(frozen=True)
class NewKey:
    plaintext: str  # shown to the caller once, never stored
    prefix: str
    hash: str


def generate_key(server_secret: bytes) -> NewKey:
    prefix = "".join(secrets.choice(_ALPHABET) for _ in range(12))
    plaintext = f"{KEY_PREFIX}{prefix}_{secrets.token_urlsafe(32)}"
    return NewKey(plaintext=plaintext, prefix=prefix, hash=hash_key(server_secret, plaintext))


def hash_key(server_secret: bytes, plaintext: str) -> str:
    return hmac.new(server_secret, plaintext.encode(), hashlib.sha256).hexdigest()


def parse_prefix(plaintext: str) -> str | None:
    """The lookup prefix of a well-formed key, or None for anything malformed."""
    match = _KEY_RE.match(plaintext)
    return match.group(1) if match else None


def verify_key(server_secret: bytes, plaintext: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_key(server_secret, plaintext), stored_hash)
