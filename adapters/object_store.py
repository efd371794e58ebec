"""ObjectStore: immutable, versioned adapters in an object store (S3 or any fsspec filesystem).

Objects under the store's prefix, for one adapter id:

    <id>/v<N>.claim              the version number N is taken (a conditional create: one writer wins)
    .uploads/<id>/v<N>           an upload of N is under way (written after the claim, removed after the
                                 manifest): what `cleanup_tmp` lists, and all it lists
    <id>/v<N>/adapter_config.json, <id>/v<N>/adapter_model.safetensors
    <id>/v<N>/manifest.json      written last: the version exists from now on (see adapters/manifest.py)
    <id>/v<N>.deleted            tombstone: N stays taken after its files are gone
    .probes/<uuid>               a writer's check that the store refuses a second create (removed again)

The protocol is in adapters/store.py; this module carries it out over fsspec. A conditional create is
`pipe_file(mode="create")`: S3 `PutObject` with `If-None-Match: *` on s3fs, an exclusive open elsewhere;
filesystems without one fall back to fsspec's check-then-write, which is not atomic between writers.
Some S3-compatible services ignore `If-None-Match` and overwrite instead: a writer checks once, before
its first upload, that a second create of one object fails, and refuses every upload
(AdapterStoreUnsafe) on a store where it does not; readers (engines, with read-only credentials) never
write, so they never check.
Every failure to talk to the store (network, credentials, missing bucket) is AdapterStoreUnavailable.
"""

import contextlib
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import fsspec

from adapters.directory_store import ADAPTER_FILES, TOMBSTONE, VERSION_DIR, check_id, check_source
from adapters.errors import (
    AdapterError,
    AdapterInvalid,
    AdapterLoadFailed,
    AdapterNotFound,
    AdapterStoreUnavailable,
    AdapterStoreUnsafe,
)
from adapters.manifest import MANIFEST_FILE, Manifest
from adapters.ref import AdapterRef

log = logging.getLogger(__name__)

_CLAIM = re.compile(r"v([1-9][0-9]*)\.claim")
_VERSION_OBJECT = re.compile(r"v([1-9][0-9]*)/(.+)")
_MAX_CLAIM_ATTEMPTS = 10_000
_UPLOADS = ".uploads"  # adapter ids never start with a dot, so this prefix is nobody's id
_PROBES = ".probes"
# A dead endpoint fails an upload in seconds, not botocore's default minute per attempt. Retries stay
# botocore's (AWS_MAX_ATTEMPTS, AWS_RETRY_MODE or the AWS config file decide).
_S3_OPTIONS: dict[str, Any] = {"config_kwargs": {"connect_timeout": 5, "read_timeout": 60}}


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of an object store URL and the store's root path in it (no trailing slash),
    with this module's timeouts; the Files API keeps its bytes there too (app/files/blobs.py)."""
    protocol = urlsplit(url).scheme
    options: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False}
    if protocol in ("s3", "s3a"):
        options |= _S3_OPTIONS
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except ImportError as error:
        message = f"adapter store {redact(url)}: install the package for {protocol}:// ({error})"
        raise ValueError(message) from None
    return fs, str(root).rstrip("/")


class ObjectStore:
    def __init__(self, url: str) -> None:
        self.url = redact(url)
        self._fs, self._root = filesystem(url)
        self._create_fault: str | None = None  # why this store cannot take uploads, once checked
        self._create_checked = False
        self._check_lock = threading.Lock()

    def check_conditional_create(self) -> str | None:
        """Check, once per process, that the store refuses to create an object twice; the reason it
        cannot take uploads, or None. AdapterStoreUnavailable (and no verdict) if it cannot be asked."""
        with self._check_lock:
            if not self._create_checked:
                self._create_fault = self._probe_conditional_create()
                self._create_checked = True
                if self._create_fault is not None:
                    log.error("adapter store %s refuses uploads: %s", self.url, self._create_fault)
            return self._create_fault

    # -- writing ---------------------------------------------------------------------------------------

    def put_dir(self, adapter_id: str, src_dir: Path) -> AdapterRef:
        """Claim the next version number, upload the two files, then publish the manifest (last)."""
        check_source(adapter_id, src_dir)
        fault = self.check_conditional_create()
        if fault is not None:
            raise AdapterStoreUnsafe(self.url, fault)
        with self._calls("upload", missing_is_failure=True):
            version = self._claim(adapter_id)
            ref = AdapterRef(adapter_id, version)
            manifest = Manifest.of_dir(ref, src_dir, ADAPTER_FILES)
            self._fs.pipe_file(self._upload_marker(ref), b"")
            try:
                for name in ADAPTER_FILES:
                    self._fs.put_file(str(src_dir / name), self._key(ref, name))
                # Create, never overwrite: only this writer holds the claim, but a swept or hand-made
                # manifest must not be replaced either.
                self._fs.pipe_file(self._key(ref, MANIFEST_FILE), manifest.to_json(), mode="create")
            except BaseException:
                with contextlib.suppress(Exception):  # best effort: the claim keeps N taken regardless
                    self._remove_files(ref)
                raise
            finally:
                with contextlib.suppress(Exception):  # left behind, the sweep removes it
                    self._fs.rm_file(self._upload_marker(ref))
        return ref

    def delete(self, adapter_id: str) -> None:
        """Remove every version: manifests first (each version disappears at once), then the rest."""
        check_id(adapter_id)
        with self._calls("delete"):
            keys = self._keys(adapter_id)
            if not keys:
                raise AdapterNotFound(adapter_id)
            manifests = [k for k in keys if k.endswith("/" + MANIFEST_FILE)]
            if manifests:
                self._fs.rm(manifests)
            self._fs.rm(self._adapter_prefix(adapter_id), recursive=True)

    def delete_version(self, ref: AdapterRef) -> None:
        """Tombstone first (N stays taken), then the manifest (the version disappears), then the files."""
        check_id(ref.adapter_id)
        with self._calls("delete"):
            if not self.exists(ref):
                raise AdapterNotFound(str(ref))
            self._fs.pipe_file(f"{self._adapter_prefix(ref.adapter_id)}/v{ref.version}.deleted", b"")
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm_file(self._key(ref, MANIFEST_FILE))
            self._remove_files(ref)

    def cleanup_tmp(self, max_age_s: float) -> int:
        """Remove the files of uploads that never got a manifest (their writer died) once nothing was
        written to them for `max_age_s`; their claims stay, so the numbers are not reused. Lists only the
        store's own `.uploads/` prefix (and then each stale upload's version): never the rest of the
        bucket, which may hold anything. Returns how many versions were swept."""
        cutoff = time.time() - max_age_s
        prefix = f"{self._root}/{_UPLOADS}"
        with self._calls("sweep"):
            markers = self._fs.find(prefix, detail=True)
        swept = 0
        for marker, info in markers.items():
            parts = marker[len(prefix) + 1 :].split("/")
            if len(parts) != 2 or (match := VERSION_DIR.fullmatch(parts[1])) is None:
                continue
            ref = AdapterRef(parts[0], int(match[1]))
            try:
                check_id(ref.adapter_id)
            except AdapterInvalid:  # not a marker we wrote: the ids we write are valid
                continue
            with self._calls("sweep"):
                files = self._fs.find(self._key(ref, ""), detail=True)
                if max([_mtime(info), *(_mtime(i) for i in files.values())]) >= cutoff:
                    continue  # a writer may still be at work
                if self._key(ref, MANIFEST_FILE) not in files:  # else it finished but died before this
                    log.info("sweeping %s: an upload that never got its manifest", ref)
                    self._remove_files(ref)
                    swept += 1
                self._fs.rm_file(marker)
        return swept

    # -- reading ---------------------------------------------------------------------------------------

    def exists(self, ref: AdapterRef) -> bool:
        check_id(ref.adapter_id)
        if ref.version < 1:
            return False
        with self._calls("lookup"):
            return bool(self._fs.exists(self._key(ref, MANIFEST_FILE)))

    def versions(self, adapter_id: str) -> list[int]:
        check_id(adapter_id)
        with self._calls("listing"):
            keys = self._keys(adapter_id)
        prefix = self._adapter_prefix(adapter_id) + "/"
        names = [key.removeprefix(prefix) for key in keys]
        deleted = {int(m[1]) for name in names if (m := TOMBSTONE.fullmatch(name))}
        return sorted(
            int(m[1])
            for name in names
            if (m := _VERSION_OBJECT.fullmatch(name)) and m[2] == MANIFEST_FILE and int(m[1]) not in deleted
        )

    def manifest_bytes(self, ref: AdapterRef) -> bytes:
        """The stored manifest of `ref`, as written. AdapterNotFound if the version is not published."""
        check_id(ref.adapter_id)
        if ref.version < 1:
            raise AdapterNotFound(str(ref))
        try:
            with self._calls("read"):
                data: bytes = self._fs.cat_file(self._key(ref, MANIFEST_FILE))
        except FileNotFoundError:
            raise AdapterNotFound(str(ref)) from None
        return data

    def download(self, manifest: Manifest, into: Path, names: Iterable[str] | None = None) -> None:
        """Copy the version's files (all, or those `names`) into the directory `into` and check them
        against `manifest`."""
        ref = manifest.ref
        names = list(manifest.files if names is None else names)
        for name in names:
            try:
                with self._calls("download"):
                    self._fs.get_file(self._key(ref, name), str(into / name))
            except FileNotFoundError:  # deleted meanwhile, or a manifest that lies
                raise AdapterNotFound(str(ref)) from None
            os.chmod(into / name, 0o600)
        problems = manifest.problems(into, names)
        if problems:
            raise AdapterLoadFailed(str(ref), "; ".join(problems))

    # -- helpers ---------------------------------------------------------------------------------------

    def _claim(self, adapter_id: str) -> int:
        version = self._next_version(adapter_id)
        for _ in range(_MAX_CLAIM_ATTEMPTS):
            body = json.dumps({"writer": uuid.uuid4().hex, "host": os.uname().nodename, "at": time.time()})
            try:
                self._fs.pipe_file(
                    f"{self._adapter_prefix(adapter_id)}/v{version}.claim", body.encode(), mode="create"
                )
            except FileExistsError:  # another writer took it: skip past everything taken by now
                version = max(version + 1, self._next_version(adapter_id))
                continue
            return version
        raise RuntimeError(f"could not claim a new version of {adapter_id!r}")

    def _next_version(self, adapter_id: str) -> int:
        prefix = self._adapter_prefix(adapter_id) + "/"
        taken = set()
        for key in self._keys(adapter_id):
            name = key.removeprefix(prefix)
            match = _CLAIM.fullmatch(name) or TOMBSTONE.fullmatch(name) or _VERSION_OBJECT.fullmatch(name)
            if match:
                taken.add(int(match[1]))
        return max(taken, default=0) + 1

    def _keys(self, adapter_id: str) -> list[str]:
        """Every object of one adapter, in one recursive listing."""
        try:
            return list(self._fs.find(self._adapter_prefix(adapter_id)))
        except FileNotFoundError:
            return []

    def _remove_files(self, ref: AdapterRef) -> None:
        keys = [self._key(ref, name) for name in (*ADAPTER_FILES, MANIFEST_FILE)]
        keys += [k for k in self._fs.find(self._key(ref, "")) if k not in keys]  # this version's alone
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm_file(key)

    def _probe_conditional_create(self) -> str | None:
        probe = f"{self._root}/{_PROBES}/{uuid.uuid4().hex}"
        with self._calls("probe", missing_is_failure=True):
            self._fs.pipe_file(probe, b"1", mode="create")
            try:
                self._fs.pipe_file(probe, b"2", mode="create")
            except FileExistsError:
                return None
            finally:
                with contextlib.suppress(Exception):
                    self._fs.rm_file(probe)
        return "it let one object be created twice (conditional creates, If-None-Match, are not honoured)"

    def _upload_marker(self, ref: AdapterRef) -> str:
        return f"{self._root}/{_UPLOADS}/{ref.adapter_id}/v{ref.version}"

    def _adapter_prefix(self, adapter_id: str) -> str:
        return f"{self._root}/{adapter_id}"

    def _key(self, ref: AdapterRef, name: str) -> str:
        return f"{self._root}/{ref.adapter_id}/v{ref.version}/{name}"

    @contextlib.contextmanager
    def _calls(self, what: str, *, missing_is_failure: bool = False) -> Iterator[None]:
        """Store failures become AdapterStoreUnavailable; answers (not found, taken) pass through, except
        that a write into a bucket that is not there is the store's failure."""
        try:
            yield
        except FileNotFoundError as error:
            if missing_is_failure:
                raise AdapterStoreUnavailable(self.url, f"{what} failed: {error}") from error
            raise
        except (AdapterError, FileExistsError):
            raise
        except Exception as error:
            raise AdapterStoreUnavailable(self.url, f"{what} failed: {error}") from error


def redact(url: str) -> str:
    """The URL without credentials, for messages and logs."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.hostname or ""))


def _mtime(info: dict[str, Any]) -> float:
    value = info.get("LastModified", info.get("mtime", info.get("created", 0.0)))
    if isinstance(value, datetime):
        return value.timestamp()
    return float(value or 0.0)
