"""FileBlobs: the Files API's bytes, in the adapter store's backend under its `.files/` prefix.

A local store keeps them in `<store>/.files/<tenant>/<file id>.jsonl` (owner-only directories, as the
adapters beside them); an object store under `<prefix>/.files/...` (adapter ids never start with a dot, so
the prefix is nobody's adapter). A blob is written whole before its row is committed (app/files/store.py),
so the database never names missing or partial bytes; a writer that dies in between leaves an object no row
names. Every failure to reach the store is AdapterStoreUnavailable (503), as for adapters.
"""

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from fsspec.implementations.local import LocalFileSystem

from adapters.errors import AdapterStoreUnavailable
from adapters.object_store import filesystem, redact

FILES_PREFIX = ".files"
_DIR_MODE = 0o700


class FileBlobs:
    def __init__(self, location: Path | str) -> None:
        """`location`: the adapter store's (Settings.resolved_adapter_store): a directory or a URL."""
        self._local = isinstance(location, Path)
        self._fs: Any
        if isinstance(location, Path):
            self._fs, self._root = LocalFileSystem(), str(location.resolve() / FILES_PREFIX)
            self.where = str(location)
        else:
            self._fs, root = filesystem(location)
            self._root, self.where = f"{root}/{FILES_PREFIX}", redact(location)

    @staticmethod
    def key(tenant_id: str, file_id: str) -> str:
        return f"{tenant_id}/{file_id}.jsonl"

    def put(self, key: str, source: Path) -> None:
        """Copy the local file `source` to the blob `key` (complete once this returns)."""
        path = self._path(key)
        with self._calls("write"):
            if self._local:
                for directory in (self._root, path.rsplit("/", 1)[0]):
                    os.makedirs(directory, mode=_DIR_MODE, exist_ok=True)
            self._fs.put_file(str(source), path)

    def open(self, key: str) -> IO[bytes]:
        """The blob, for reading (the caller closes it); a blob its row names but the store lacks is the
        store's failure."""
        with self._calls("read"):
            handle: IO[bytes] = self._fs.open(self._path(key), "rb")
            return handle

    def remove(self, key: str) -> None:
        """Delete the blob; one already gone is fine (a sweep racing a delete)."""
        with self._calls("delete"), contextlib.suppress(FileNotFoundError):
            self._fs.rm_file(self._path(key))

    def _path(self, key: str) -> str:
        return f"{self._root}/{key}"

    @contextlib.contextmanager
    def _calls(self, what: str) -> Iterator[None]:
        try:
            yield
        except Exception as error:
            raise AdapterStoreUnavailable(self.where, f"file {what} failed: {error}") from error
