"""AdapterStore: immutable, versioned adapters, in a local directory or an object store, chosen by URL.

`AdapterStore(location)` takes a plain path or `file:///dir` (a directory on this machine: the embedded
default, adapters/directory_store.py), or `s3://bucket/prefix` (any S3-compatible service; endpoint,
region and credentials come from the standard AWS environment and config: AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, ~/.aws) or another fsspec URL whose package
is installed (adapters/object_store.py). Every backend keeps the same guarantees:

- Versions are immutable, numbered from 1 per adapter id, and never reused while the id exists:
  `delete_version` leaves a `v<N>.deleted` tombstone, so an AdapterRef keeps naming the same bytes.
- A version is visible only once complete. On disk it appears by one rename of a fully written, fsynced
  staging directory. An object store has no rename: the writer uploads the files under `<id>/v<N>/`, then
  writes `<id>/v<N>/manifest.json` LAST (each file's name, size and sha256); readers take a version to
  exist only if its manifest does, and check the files they copy against it (a mismatch is refused as
  AdapterLoadFailed). A writer killed between writes leaves manifest-less objects: invisible, and swept
  by `cleanup_tmp` once old.
- Concurrent uploads under one id never overwrite each other. On disk, renaming onto an existing version
  fails. In an object store, a writer first claims N by a conditional create of `<id>/v<N>.claim` (S3
  `PutObject` with `If-None-Match: *`); only the claimant ever writes under `<id>/v<N>/`, and a loser
  moves on to the next free number. Claims and tombstones both count as taken.
- The store failing (unreachable, refused) is AdapterStoreUnavailable, never a wrong answer. An object
  store that does not refuse a second create of one object cannot keep writers apart: uploads to it are
  refused with AdapterStoreUnsafe (`check_writes` asks once, at the ingress's start).

Reading: `path(ref)` is a local directory holding the version's files. For a local store it is the
store's own directory (no copy); for an object store it is the node cache's verified copy
(adapters/node_cache.py), fetched on a miss. A cache hit, and `exists` of a cached version, need no store
access, so adapters already on a node keep serving while the store is down. Given the registry's digests
(`digests`), the node cache checks every version against them, not only against its own manifest.
"""

from pathlib import Path
from urllib.parse import unquote, urlsplit

from adapters.directory_store import ADAPTER_FILES, DirectoryStore, remove_stale
from adapters.errors import AdapterNotFound
from adapters.node_cache import DEFAULT_CACHE_BYTES, NodeCache, default_cache_dir
from adapters.object_store import ObjectStore
from adapters.ref import AdapterRef
from adapters.registered_digest import DigestSource

__all__ = ["ADAPTER_FILES", "AdapterStore", "remove_stale", "store_location"]


def store_location(value: str | Path) -> Path | str:
    """A local store as a Path (a plain path or a file:// URL), any other store as its URL."""
    if isinstance(value, Path):
        return value
    parts = urlsplit(value)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"file:// adapter store must be on this machine, got host {parts.netloc!r}")
        return Path(unquote(parts.path))
    if len(parts.scheme) > 1 and "://" in value:  # "C:" or a relative path with a colon is not a URL
        return value
    return Path(value)


def absolute_location(value: str | Path) -> Path | str:
    """`store_location`, with a local path made absolute (for processes started elsewhere)."""
    location = store_location(value)
    return location.resolve() if isinstance(location, Path) else location


class AdapterStore:
    def __init__(
        self,
        location: str | Path,
        *,
        cache_dir: Path | None = None,
        cache_max_bytes: int = DEFAULT_CACHE_BYTES,
        digests: DigestSource | None = None,
    ) -> None:
        """`cache_dir`, `cache_max_bytes`, `digests` (the registry's): the node cache of an object store
        (unused for a local one)."""
        self.location = store_location(location)
        self.cache: NodeCache | None = None
        self._local: DirectoryStore | None = None
        self._remote: ObjectStore | None = None
        if isinstance(self.location, Path):
            self._local = DirectoryStore(self.location)
        else:
            self._remote = ObjectStore(self.location)
            self.cache = NodeCache(cache_dir or default_cache_dir(), cache_max_bytes, digests)

    @property
    def root(self) -> Path:
        """The directory of a local store."""
        if self._local is None:
            raise TypeError(f"adapter store {self} is an object store, not a local directory")
        return self._local.root

    def __str__(self) -> str:
        return str(self._local.root) if self._local else self._backend_url()

    def check_writes(self) -> str | None:
        """Why uploads to this store are refused, or None (a local store always takes them). Asks an
        object store once per process; AdapterStoreUnavailable if it cannot be asked now."""
        return None if self._remote is None else self._remote.check_conditional_create()

    def put_dir(self, adapter_id: str, src_dir: Path) -> AdapterRef:
        """Copy the adapter's two files from `src_dir` into a new version: highest existing + 1, from 1."""
        if self._local:
            return self._local.put_dir(adapter_id, src_dir)
        assert self._remote
        return self._remote.put_dir(adapter_id, src_dir)

    def path(self, ref: AdapterRef) -> Path:
        """Local directory of one version's files. Raises AdapterNotFound if it does not exist."""
        if self._local:
            return self._local.path(ref)
        assert self._remote and self.cache
        return self.cache.get(ref, self._remote)

    def config_dir(self, ref: AdapterRef) -> Path:
        """A local directory holding at least the version's adapter_config.json: `path(ref)` for a local
        store or a cached version, otherwise the config alone (an object store's weights are not fetched)."""
        if self._local:
            return self._local.path(ref)
        assert self._remote and self.cache
        return self.cache.config_dir(ref, self._remote)

    def exists(self, ref: AdapterRef) -> bool:
        if self._local:
            return self._local.exists(ref)
        assert self._remote and self.cache
        return self.cache.lookup(ref) is not None or self._remote.exists(ref)

    def versions(self, adapter_id: str) -> list[int]:
        if self._local:
            return self._local.versions(adapter_id)
        assert self._remote
        return self._remote.versions(adapter_id)

    def latest(self, adapter_id: str) -> AdapterRef:
        versions = self.versions(adapter_id)
        if not versions:
            raise AdapterNotFound(adapter_id)
        return AdapterRef(adapter_id, versions[-1])

    def delete(self, adapter_id: str) -> None:
        """Remove every version."""
        if self._local:
            self._local.delete(adapter_id)
        else:
            assert self._remote
            self._remote.delete(adapter_id)

    def delete_version(self, ref: AdapterRef) -> None:
        if self._local:
            self._local.delete_version(ref)
        else:
            assert self._remote
            self._remote.delete_version(ref)

    def cleanup_tmp(self, max_age_s: float) -> int:
        """Remove what writers killed mid-upload left, untouched for `max_age_s`. Returns how many."""
        if self._local:
            return self._local.cleanup_tmp(max_age_s)
        assert self._remote
        return self._remote.cleanup_tmp(max_age_s)

    def _backend_url(self) -> str:
        assert self._remote
        return self._remote.url
