"""AdapterStore: immutable, versioned adapter directories on local disk.

Layout: `root/<adapter_id>/v<N>/{adapter_config.json, adapter_model.safetensors}`. A version becomes visible
only through one `os.rename` of a fully written and fsynced staging directory, so readers never see a half
version and a crash leaves at most a stale `root/.tmp/<uuid>` behind (see `cleanup_tmp`). Renaming a
directory onto a non-empty one fails, which is how concurrent writers detect that a version was taken.
Version numbers are never reused: `delete_version` leaves a `v<N>.deleted` tombstone, so an AdapterRef
keeps naming the same bytes for as long as the adapter id exists.
"""

import errno
import os
import re
import shutil
import time
import uuid
from pathlib import Path

from adapters.errors import AdapterInvalid, AdapterNotFound
from adapters.ref import AdapterRef
from adapters.spec import CONFIG_FILE, WEIGHTS_FILE

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
_ADAPTER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_VERSION_DIR = re.compile(r"v([1-9][0-9]*)")
_TOMBSTONE = re.compile(r"v([1-9][0-9]*)\.deleted")
_MAX_PUBLISH_ATTEMPTS = 10_000  # only reached if versions are taken faster than we can list them


class AdapterStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._tmp = root / ".tmp"
        self._trash = root / ".trash"
        for directory in (self._tmp, self._trash):
            directory.mkdir(parents=True, exist_ok=True)

    def put_dir(self, adapter_id: str, src_dir: Path) -> AdapterRef:
        """Copy the adapter's two files from `src_dir` into a new version: highest existing + 1, from 1."""
        _check_id(adapter_id)
        problems = [f"missing {name}" for name in ADAPTER_FILES if not (src_dir / name).is_file()]
        problems += [
            f"{name} must not be a symlink" for name in ADAPTER_FILES if (src_dir / name).is_symlink()
        ]
        if problems:
            raise AdapterInvalid(problems)
        staging = self._tmp / uuid.uuid4().hex
        staging.mkdir()
        try:
            for name in ADAPTER_FILES:
                _copy_durably(src_dir / name, staging / name)
            _fsync_dir(staging)
            return self._publish(adapter_id, staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone already after a successful rename

    def path(self, ref: AdapterRef) -> Path:
        """Directory of one version. Raises AdapterNotFound if it does not exist."""
        _check_id(ref.adapter_id)
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
        _check_id(adapter_id)
        return sorted(self._numbers(adapter_id, _VERSION_DIR))

    def latest(self, adapter_id: str) -> AdapterRef:
        versions = self.versions(adapter_id)
        if not versions:
            raise AdapterNotFound(adapter_id)
        return AdapterRef(adapter_id, versions[-1])

    def delete(self, adapter_id: str) -> None:
        """Remove every version. The rename makes it atomic; removing the files happens after."""
        _check_id(adapter_id)
        self._discard(self.root / adapter_id, not_found=adapter_id)

    def delete_version(self, ref: AdapterRef) -> None:
        version_dir = self.path(ref)
        # Tombstone first: a writer that lists the directory from now on counts this number as taken.
        try:
            (version_dir.parent / f"v{ref.version}.deleted").touch()
        except FileNotFoundError:  # the whole adapter was deleted meanwhile
            raise AdapterNotFound(str(ref)) from None
        _fsync_dir(version_dir.parent)
        self._discard(version_dir, not_found=str(ref))

    def cleanup_tmp(self, max_age_s: float) -> int:
        """Remove staging and trash dirs older than `max_age_s` (left by crashes). Returns how many."""
        cutoff = time.time() - max_age_s
        removed = 0
        for directory in (self._tmp, self._trash):
            for entry in directory.iterdir():
                try:
                    stale = entry.stat().st_mtime < cutoff
                except FileNotFoundError:
                    continue  # finished or removed meanwhile
                if stale:
                    shutil.rmtree(entry, ignore_errors=True)
                    removed += 1
        return removed

    def _publish(self, adapter_id: str, staging: Path) -> AdapterRef:
        adapter_dir = self.root / adapter_id
        version = self._next_version(adapter_id)
        for _ in range(_MAX_PUBLISH_ATTEMPTS):
            adapter_dir.mkdir(exist_ok=True)
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
            _fsync_dir(adapter_dir)
            _fsync_dir(self.root)
            return AdapterRef(adapter_id, version)
        raise RuntimeError(f"could not publish a new version of {adapter_id!r}")

    def _next_version(self, adapter_id: str) -> int:
        taken = self._numbers(adapter_id, _VERSION_DIR) | self._numbers(adapter_id, _TOMBSTONE)
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
        _fsync_dir(target.parent)
        shutil.rmtree(trash, ignore_errors=True)


def _check_id(adapter_id: str) -> None:
    if not isinstance(adapter_id, str) or _ADAPTER_ID.fullmatch(adapter_id) is None:
        rule = "1-128 characters of A-Z a-z 0-9 . _ -, starting with a letter or digit"
        raise AdapterInvalid([f"invalid adapter id {adapter_id!r}: use {rule}"])


def _copy_durably(src: Path, dst: Path) -> None:
    with src.open("rb") as reader, dst.open("xb") as writer:
        shutil.copyfileobj(reader, writer, length=1 << 20)
        writer.flush()
        os.fsync(writer.fileno())


def _fsync_dir(directory: Path) -> None:
    # Makes the directory's entries (a new file, a rename) durable, not just the file contents.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
