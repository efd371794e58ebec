"""Owner-only files: databases, the outbox and secrets are nobody else's to read.

Modes are given when a file is created (os.open with a mode), never fixed by a chmod
afterwards, which leaves a window in which another user can open it; the umask can only take bits away.
"""

import contextlib
import os
import secrets
from pathlib import Path

PRIVATE_FILE_MODE = 0o600


def create_private_file(path: Path) -> None:
    """Make sure `path` exists, created owner-only if it did not (an SQLite database, before it opens)."""
    path.parent.mkdir(parents=True, exist_ok=True)  # data_dir: it also holds models others may read
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE_MODE))


def write_secret(path: Path, text: str) -> bool:
    """Write a new secret file, owner-only from its first byte; False (nothing written) if it exists."""
    path.parent.mkdir(parents=True, exist_ok=True)  # data_dir: it also holds models others may read
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, PRIVATE_FILE_MODE)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    return True


def publish_secret(path: Path, text: str) -> bool:
    """Put a new secret at `path` whole or not at all: written (0600) under a temporary name, then linked
    into place, so neither a crash mid-write nor a concurrent reader ever finds it empty or partial there.
    False if a secret was there already (another process won): read that one."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    try:
        write_secret(tmp, text)
        os.link(tmp, path)  # atomic, and never replaces: every process ends up reading one secret
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return True
