"""DirectoryStore: immutable, versioned adapter directories on local disk (the `file://` backend).

Layout: `root/<adapter_id>/v<N>/{adapter_config.json, adapter_model.safetensors}`. A version becomes visible
only through one `os.rename` of a fully written and fsynced staging directory, so readers never see a half
version and a crash leaves at most a stale `root/.tmp/<uuid>` behind (`cleanup_tmp` removes it at ingress
startup). Renaming a directory onto a non-empty one fails, which is how concurrent writers detect that a
version was taken. Everything is created owner-only (0700/0600): tenants' weights are nobody else's.
Version numbers are never reused: `delete_version` leaves a `v<N>.deleted` tombstone, so an AdapterRef
keeps naming the same bytes for as long as the adapter id exists.
"""

import contextlib
import errno
import logging
import os
import re
import shutil
import stat
import time
import uuid
from pathlib import Path

from adapters.errors import AdapterInvalid, AdapterNotFound
from adapters.private_dir import UnsafeDirectory, open_plain_dir
from adapters.ref import AdapterRef
from adapters.spec import CONFIG_FILE, WEIGHTS_FILE

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
_ADAPTER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
VERSION_DIR = re.compile(r"v([1-9][0-9]*)")
TOMBSTONE = re.compile(r"v([1-9][0-9]*)\.deleted")
_DIR_MODE = 0o700
_FILE_MODE = 0o600
_MAX_PUBLISH_ATTEMPTS = 10_000  # only reached if versions are taken faster than we can list them
log = logging.getLogger(__name__)


class DirectoryStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._tmp = root / ".tmp"
        self._trash = root / ".trash"
        # Owner-only from creation (tenants' weights); parents above the root are the operator's.
        root.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
        for directory in (self._tmp, self._trash):
            directory.mkdir(mode=_DIR_MODE, exist_ok=True)

    def put_dir(self, adapter_id: str, src_dir: Path) -> AdapterRef:
        """Copy the adapter's two files from `src_dir` into a new version: highest existing + 1, from 1."""
        check_source(adapter_id, src_dir)
        staging = self._tmp / uuid.uuid4().hex
        staging.mkdir(mode=_DIR_MODE)
        try:
            for name in ADAPTER_FILES:
                _copy_durably(src_dir / name, staging / name)
            fsync_path(staging)
            return self._publish(adapter_id, staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone already after a successful rename

    def path(self, ref: AdapterRef) -> Path:
        """Directory of one version. Raises AdapterNotFound if it does not exist."""
        check_id(ref.adapter_id)
        version_dir = self.root / ref.adapter_id / f"v{ref.version}"
        if ref.version < 1 or not version_dir.is_dir():
            raise AdapterNotFound(str(ref))
        return version_dir

    def exists(self, ref: AdapterRef) -> bool:
        try:
            self.path(ref)
        except AdapterNotFound:
            return False
        return True

    def versions(self, adapter_id: str) -> list[int]:
        check_id(adapter_id)
        return sorted(self._numbers(adapter_id, VERSION_DIR))

    def delete(self, adapter_id: str) -> None:
        """Remove every version. The rename makes it atomic; removing the files happens after."""
        check_id(adapter_id)
        self._discard(self.root / adapter_id, not_found=adapter_id)

    def delete_version(self, ref: AdapterRef) -> None:
        version_dir = self.path(ref)
        # Tombstone first: a writer that lists the directory from now on counts this number as taken.
        try:
            (version_dir.parent / f"v{ref.version}.deleted").touch(mode=_FILE_MODE)
        except FileNotFoundError:  # the whole adapter was deleted meanwhile
            raise AdapterNotFound(str(ref)) from None
        fsync_path(version_dir.parent)
        self._discard(version_dir, not_found=str(ref))

    def cleanup_tmp(self, max_age_s: float) -> int:
        """Remove staging and trash dirs untouched for `max_age_s` (left by crashes). Returns how many."""
        return sum(remove_stale(directory, max_age_s) for directory in (self._tmp, self._trash))

    def _publish(self, adapter_id: str, staging: Path) -> AdapterRef:
        adapter_dir = self.root / adapter_id
        version = self._next_version(adapter_id)
        for _ in range(_MAX_PUBLISH_ATTEMPTS):
            adapter_dir.mkdir(mode=_DIR_MODE, exist_ok=True)
            try:
                os.rename(staging, adapter_dir / f"v{version}")
            except FileNotFoundError:  # the adapter was deleted between mkdir and rename
                version = self._next_version(adapter_id)
                continue
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                version = max(version + 1, self._next_version(adapter_id))  # another writer took it
                continue
            fsync_path(adapter_dir)
            fsync_path(self.root)
            return AdapterRef(adapter_id, version)
        raise RuntimeError(f"could not publish a new version of {adapter_id!r}")

    def _next_version(self, adapter_id: str) -> int:
        taken = self._numbers(adapter_id, VERSION_DIR) | self._numbers(adapter_id, TOMBSTONE)
        return max(taken, default=0) + 1

    def _numbers(self, adapter_id: str, pattern: re.Pattern[str]) -> set[int]:
        try:
            names = os.listdir(self.root / adapter_id)
        except FileNotFoundError:
            return set()
        return {int(match[1]) for name in names if (match := pattern.fullmatch(name))}

    def _discard(self, target: Path, *, not_found: str) -> None:
        trash = self._trash / uuid.uuid4().hex
        try:
            os.rename(target, trash)
        except FileNotFoundError:
            raise AdapterNotFound(not_found) from None
        fsync_path(target.parent)
        shutil.rmtree(trash, ignore_errors=True)


def remove_stale(directory: Path, max_age_s: float) -> int:
    """Remove the entries of `directory` in which nothing was written for `max_age_s`: what a process killed
    mid-upload or mid-publish left. An entry still being written stays, since its newest mtime (the files
    inside included: appending to a file does not touch its directory) is recent. Returns how many.

    Links are never followed: not `directory` itself (one planted in its place would hand us another
    directory to empty), nor anything inside; everything is opened relative to the directory's descriptor."""
    cutoff = time.time() - max_age_s
    try:
        fd = open_plain_dir(directory)
    except UnsafeDirectory as error:
        log.warning("not cleaning up: %s", error)
        return 0
    if fd is None:
        return 0
    removed = 0
    try:
        for name in os.listdir(fd):
            try:
                is_dir, newest = _newest_mtime(name, fd)
                if newest >= cutoff:
                    continue
                if is_dir:
                    shutil.rmtree(name, ignore_errors=True, dir_fd=fd)
                else:
                    os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                continue  # finished or removed meanwhile
            removed += 1
    finally:
        os.close(fd)
    return removed


def _newest_mtime(name: str, dir_fd: int) -> tuple[bool, float]:
    """(whether `name` is a real directory, the newest mtime in it), never through a link."""
    info = os.lstat(name, dir_fd=dir_fd)
    if not stat.S_ISDIR(info.st_mode):
        return False, info.st_mtime
    newest = info.st_mtime
    for _, dirs, files, root_fd in os.fwalk(name, dir_fd=dir_fd):  # follow_symlinks=False
        for entry in [*dirs, *files]:
            with contextlib.suppress(FileNotFoundError):
                newest = max(newest, os.lstat(entry, dir_fd=root_fd).st_mtime)
    return True, newest


def check_source(adapter_id: str, src_dir: Path) -> None:
    """Raise AdapterInvalid unless `adapter_id` is well formed and `src_dir` has both files, not as links."""
    check_id(adapter_id)
    problems = [f"missing {name}" for name in ADAPTER_FILES if not (src_dir / name).is_file()]
    problems += [f"{name} must not be a symlink" for name in ADAPTER_FILES if (src_dir / name).is_symlink()]
    if problems:
        raise AdapterInvalid(problems)


def check_id(adapter_id: str) -> None:
    if not isinstance(adapter_id, str) or _ADAPTER_ID.fullmatch(adapter_id) is None:
        rule = "1-128 characters of A-Z a-z 0-9 . _ -, starting with a letter or digit"
        raise AdapterInvalid([f"invalid adapter id {adapter_id!r}: use {rule}"])


def _copy_durably(src: Path, dst: Path) -> None:
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE)
    with src.open("rb") as reader, os.fdopen(fd, "wb") as writer:
        shutil.copyfileobj(reader, writer, length=1 << 20)
        writer.flush()
        os.fsync(writer.fileno())


def fsync_path(directory: Path) -> None:
    """fsync a file, or a directory: makes its entries (a new file, a rename) durable, not just contents."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
