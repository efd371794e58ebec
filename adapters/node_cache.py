"""NodeCache: a node's local copies of adapter versions read from an object store.

Layout under the cache directory (owner-only, like the store):

    <id>/v<N>.<key>/{manifest.json, adapter_config.json, adapter_model.safetensors}
        one version, copied whole; <key> is the first 16 hex of the sha256 of its manifest, which names
        every file's sha256, so the directory name authenticates the manifest and the manifest the files
    .tmp/<uuid>/        a copy being fetched; renamed into place only once it matched its manifest
    .locks/<id>@v<N>    flock'd while one process fetches that version: the others wait, then hit
    .evict.lock         flock'd while one process evicts
    .trash/<uuid>/      an evicted or broken entry, renamed out of sight before it is removed
    .configs/<id>/v<N>.<key>/adapter_config.json
                        the config alone, for checking a version without fetching its weights

The directory and its subfolders are created owner-only without following links, and refused (with
UnsafeDirectory, at start) unless they are real directories of this user that nobody else can write:
the default location is a predictable path under /tmp, where another user could have planted a link
for our cleanup to follow. Each version's manifest is checked against the registry's digest of it
(`digests`, on nodes that can read the registry) before the manifest is trusted with the files, in the
store and in the cache alike: an entry that disagrees is thrown away and fetched again, and a stored
version that disagrees is refused.

Several replicas (processes) on one node share it. An entry appears by one rename of a complete, verified
copy, so nobody sees half of one. Before an entry is used, its files are checked against its manifest
(sizes, then sha256; a process skips the hash of files whose inode, size and mtime it already verified):
a corrupted or truncated entry is thrown away and fetched again. A hit needs no store access at all,
which is what keeps cached adapters serving while the store is down; versions are immutable, so a copy
never goes stale. The size bound (bytes of files) is kept by evicting the least recently used entries
(each hit touches its entry's mtime) after every fetch; the entry just fetched is never evicted, so one
version larger than the bound still loads. A cache directory wiped while serving is re-created and
re-filled on the next miss.
"""

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

from adapters.directory_store import fsync_path, remove_stale
from adapters.errors import AdapterLoadFailed, AdapterNotFound
from adapters.manifest import MANIFEST_FILE, Manifest, content_key
from adapters.private_dir import PRIVATE_DIR_MODE, ensure_private_dir
from adapters.ref import AdapterRef
from adapters.registered_digest import DigestSource, RegisteredDigest
from adapters.spec import CONFIG_FILE

log = logging.getLogger(__name__)

_DIR_MODE = PRIVATE_DIR_MODE
_SUBDIRS = (".tmp", ".locks", ".trash", ".configs")
_STALE_FETCH_S = 3600.0  # a fetch untouched this long was killed: its .tmp copy is swept
DEFAULT_CACHE_BYTES = 10 * 2**30


class VersionSource(Protocol):
    """Where a miss is fetched from (ObjectStore)."""

    def manifest_bytes(self, ref: AdapterRef) -> bytes: ...

    def download(self, manifest: Manifest, into: Path, names: Iterable[str] | None = None) -> None: ...


def default_cache_dir() -> Path:
    """Used when no directory is configured: per user, so two users on a host never share copies."""
    return Path(tempfile.gettempdir()) / f"loraplex-adapter-cache-{os.getuid()}"


class NodeCache:
    def __init__(
        self, root: Path, max_bytes: int = DEFAULT_CACHE_BYTES, digests: DigestSource | None = None
    ) -> None:
        """`digests`: the registry's, where this node can read it; without, manifests are trusted."""
        if max_bytes < 1:
            raise ValueError(f"the adapter cache needs a positive size bound, got {max_bytes} bytes")
        self.root = root
        self.max_bytes = max_bytes
        self.fetches = 0  # copies this process made from the store (a test and bench counter)
        self._digests = digests
        self._registered: dict[AdapterRef, RegisteredDigest] = {}  # versions are immutable: asked once
        self._verified: dict[Path, tuple[tuple[int, int, int], ...]] = {}
        self._memo_lock = threading.Lock()
        self._dirs()
        remove_stale(self.root / ".tmp", _STALE_FETCH_S)
        remove_stale(self.root / ".trash", 0)

    def get(self, ref: AdapterRef, source: VersionSource) -> Path:
        """A local directory holding `ref`'s files, verified; fetched from `source` on a miss."""
        hit = self.lookup(ref)
        if hit is not None:
            return hit
        self._dirs()
        with _flock(self.root / ".locks" / f"{ref.adapter_id}@v{ref.version}"):
            hit = self.lookup(ref)  # another process fetched it while this one waited
            if hit is not None:
                return hit
            entry = self._fetch(ref, source)
        self._evict(keep=entry)
        return entry

    def config_dir(self, ref: AdapterRef, source: VersionSource) -> Path:
        """A local directory holding at least `ref`'s adapter_config.json, verified: the whole entry if
        cached, else the config alone (two small reads, not the weights: the engine checks a version
        before it loads it, on its loop thread). Configs are kept under .configs/, a few KB each."""
        hit = self.lookup(ref)
        if hit is not None:
            return hit
        data = source.manifest_bytes(ref)
        manifest = self._trusted(ref, data)
        self._dirs()
        parent = self.root / ".configs" / ref.adapter_id
        entry = parent / f"v{ref.version}.{content_key(data)}"
        with contextlib.suppress(FileNotFoundError):
            if not manifest.problems(entry, [CONFIG_FILE]):
                return entry
        staging = self.root / ".tmp" / uuid.uuid4().hex
        staging.mkdir(mode=_DIR_MODE)
        try:
            source.download(manifest, staging, [CONFIG_FILE])
            parent.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
            shutil.rmtree(entry, ignore_errors=True)  # a broken one
            with contextlib.suppress(OSError):  # another process put the same config there meanwhile
                os.rename(staging, entry)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return entry

    def lookup(self, ref: AdapterRef) -> Path | None:
        """The verified entry of `ref`, touched as just used; None if there is none (or it was broken)."""
        try:
            candidates = list((self.root / ref.adapter_id).glob(f"v{ref.version}.*"))
        except OSError:
            return None
        for entry in candidates:
            try:
                problems = self._problems(ref, entry)
            except FileNotFoundError:  # evicted or wiped meanwhile: a miss, not a fault
                continue
            if not problems:
                with contextlib.suppress(FileNotFoundError):
                    os.utime(entry)
                return entry
            log.warning("adapter cache entry %s is broken (%s): fetching it again", entry, problems)
            self._discard(entry)
        return None

    def total_bytes(self) -> int:
        return sum(size for _, _, size in self._entries())

    def _fetch(self, ref: AdapterRef, source: VersionSource) -> Path:
        data = source.manifest_bytes(ref)
        manifest = self._trusted(ref, data)
        staging = self.root / ".tmp" / uuid.uuid4().hex
        staging.mkdir(mode=_DIR_MODE)
        try:
            source.download(manifest, staging)
            fd = os.open(staging / MANIFEST_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            for name in [*manifest.files, MANIFEST_FILE]:
                fsync_path(staging / name)
            fsync_path(staging)
            parent = self.root / ref.adapter_id
            parent.mkdir(mode=_DIR_MODE, exist_ok=True)
            entry = parent / f"v{ref.version}.{content_key(data)}"
            try:
                os.rename(staging, entry)
            except OSError as error:  # a fetch that did not hold our lock (the dir was wiped) won
                if not entry.is_dir():
                    raise
                log.debug("adapter cache entry %s appeared meanwhile (%s)", entry, error)
            fsync_path(parent)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self.fetches += 1
        log.info("adapter %s fetched into the node cache (%s)", ref, entry)
        return entry

    def _problems(self, ref: AdapterRef, entry: Path) -> list[str]:
        data = (entry / MANIFEST_FILE).read_bytes()
        if not entry.name.endswith("." + content_key(data)):
            return ["its manifest does not match the entry's name"]
        try:
            manifest = Manifest.from_json(data, ref)
        except AdapterLoadFailed as error:
            return [str(error)]
        contradiction = self._contradiction(ref, manifest)
        if contradiction is not None:
            return [contradiction]
        signature = tuple(_signature(entry / name) for name in sorted(manifest.files))
        with self._memo_lock:
            if self._verified.get(entry) == signature:
                return []
        problems = manifest.problems(entry)
        if not problems:
            with self._memo_lock:
                self._verified[entry] = signature
        return problems

    def _trusted(self, ref: AdapterRef, data: bytes) -> Manifest:
        """The store's manifest of `ref`, once it agrees with the registry (else nothing is fetched)."""
        manifest = Manifest.from_json(data, ref)
        contradiction = self._contradiction(ref, manifest)
        if contradiction is not None:
            log.error("the stored manifest of %s does not match the registry: %s", ref, contradiction)
            raise AdapterLoadFailed(
                str(ref), f"the stored version is not the registered one: {contradiction}"
            )
        return manifest

    def _contradiction(self, ref: AdapterRef, manifest: Manifest) -> str | None:
        """How `manifest` disagrees with the registry's digest of `ref`; None if it agrees (or no registry
        is known here). AdapterNotFound if the registry has no such version."""
        if self._digests is None:
            return None
        with self._memo_lock:
            registered = self._registered.get(ref)
        if registered is None:
            registered = self._digests.registered(ref)
            if registered is None:
                raise AdapterNotFound(str(ref))
            with self._memo_lock:
                self._registered[ref] = registered
        return manifest.contradiction(registered)

    def _entries(self) -> list[tuple[Path, float, int]]:
        """(entry, last use, bytes) of every entry."""
        found = []
        for entry in self.root.glob("*/v*.*"):
            if entry.parent.name.startswith("."):  # .locks, .tmp, .trash: never entries
                continue
            with contextlib.suppress(FileNotFoundError):
                size = sum(f.stat().st_size for f in entry.iterdir() if f.name != MANIFEST_FILE)
                found.append((entry, entry.stat().st_mtime, size))
        return found

    def _evict(self, *, keep: Path) -> None:
        self._dirs()
        with _flock(self.root / ".evict.lock"):
            entries = sorted(self._entries(), key=lambda item: item[1])
            total = sum(size for _, _, size in entries)
            for entry, _, size in entries:
                if total <= self.max_bytes:
                    break
                if entry == keep:
                    continue
                log.info("evicting %s from the adapter cache (%d bytes over the bound)", entry, total)
                self._discard(entry)
                total -= size

    def _discard(self, entry: Path) -> None:
        trash = self.root / ".trash" / uuid.uuid4().hex
        with self._memo_lock:
            self._verified.pop(entry, None)
        try:
            self._dirs()
            os.rename(entry, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def _dirs(self) -> None:
        ensure_private_dir(self.root, _SUBDIRS)


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _signature(path: Path) -> tuple[int, int, int]:
    stat = path.stat()
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns)
