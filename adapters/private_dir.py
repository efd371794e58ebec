"""Owner-only directories nobody else can have planted: made without following links, checked before use.

A directory at a predictable path (the per-user default cache under /tmp) may exist before we look, made
by someone else: as a symlink to a directory of ours (whose contents our cleanup would then delete), or as
a directory they own or can write, holding links of their own. `mkdir(exist_ok=True)` accepts all of
these. Here each directory is opened with O_NOFOLLOW and checked on its descriptor, its subfolders
relative to it: a real directory, ours, writable by nobody else, in a parent nobody else can rename it
in. Read or search bits for others are taken away (a warning says so); anything else is refused with
UnsafeDirectory, which names the path and the fault for the operator to fix.
"""

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

PRIVATE_DIR_MODE = 0o700
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class UnsafeDirectory(Exception):
    """A directory we would keep private files in (and clean up) that someone else controls or could."""

    def __init__(self, path: Path, fault: str) -> None:
        super().__init__(f"refusing to use {path}: {fault}")
        self.path = path


def ensure_private_dir(path: Path, subdirs: Iterable[str] = ()) -> None:
    """Create `path` and its `subdirs` (plain names) owner-only if missing; raise UnsafeDirectory unless
    each is a real directory of ours that only we can write, in a parent others cannot write (or sticky).
    Directories above `path` are the operator's: created if missing, not checked beyond the parent."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _check_parent(path)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, PRIVATE_DIR_MODE)
    fd = _open_private(path, path, None)
    try:
        for name in subdirs:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, PRIVATE_DIR_MODE, dir_fd=fd)
            os.close(_open_private(path / name, name, fd))
    finally:
        os.close(fd)


def open_plain_dir(path: Path) -> int | None:
    """A descriptor of the directory `path` itself (never through a link); None if it does not exist."""
    try:
        return _open(path, path, None)
    except FileNotFoundError:
        return None


def _open_private(shown: Path, name: str | Path, dir_fd: int | None) -> int:
    fd = _open(shown, name, dir_fd)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise UnsafeDirectory(
                shown, f"it belongs to uid {info.st_uid}, not to this user ({os.geteuid()})"
            )
        mode = stat.S_IMODE(info.st_mode)
        if mode & _OTHERS_WRITE:
            fault = f"others may write in it (mode {mode:04o}), so anything in it may be theirs"
            raise UnsafeDirectory(shown, fault + "; check its contents, then chmod 700 it")
        if mode & 0o077:
            log.warning("%s was readable by others (mode %04o); made it %04o", shown, mode, PRIVATE_DIR_MODE)
            os.fchmod(fd, PRIVATE_DIR_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open(shown: Path, name: str | Path, dir_fd: int | None) -> int:
    try:
        return os.open(name, _OPEN_DIR, dir_fd=dir_fd)
    except OSError as error:
        if error.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        link = stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
        raise UnsafeDirectory(shown, "it is a symbolic link" if link else "it is not a directory") from None


def _check_parent(path: Path) -> None:
    """Whoever may write in the parent may rename our directory away and put their own in its place,
    unless the parent is sticky (/tmp), where only an entry's owner may rename it."""
    parent = path.parent.resolve()
    info = parent.stat()
    mode = stat.S_IMODE(info.st_mode)
    if mode & _OTHERS_WRITE and not mode & stat.S_ISVTX:
        raise UnsafeDirectory(
            path, f"others may write in its parent {parent} (mode {mode:04o}) and replace it"
        )
