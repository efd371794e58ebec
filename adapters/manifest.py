"""Manifest: what one complete version of an adapter holds, file by file (size and sha256).

An object store has no directory rename, so a version there becomes visible by its manifest, written last:
readers take a version to exist only if its manifest does, and check every file they copy against it.
The node cache keeps the manifest beside the files it copied and re-checks them before each use.
"""

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from adapters.errors import AdapterLoadFailed
from adapters.ref import AdapterRef
from adapters.registered_digest import RegisteredDigest
from adapters.spec import WEIGHTS_FILE

MANIFEST_FILE = "manifest.json"
_FORMAT = 1


@dataclass(frozen=True, slots=True)
class FileDigest:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    ref: AdapterRef
    files: dict[str, FileDigest]

    @classmethod
    def of_dir(cls, ref: AdapterRef, directory: Path, names: Iterable[str]) -> "Manifest":
        return cls(ref, {name: digest_file(directory / name) for name in names})

    def to_json(self) -> bytes:
        body = {
            "format": _FORMAT,
            "adapter_id": self.ref.adapter_id,
            "version": self.ref.version,
            "files": {name: {"size": d.size, "sha256": d.sha256} for name, d in sorted(self.files.items())},
        }
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, ref: AdapterRef) -> "Manifest":
        """Parse the manifest stored for `ref`; a malformed one, or one naming another version, is refused."""
        try:
            body = json.loads(data)
            files = {
                str(name): FileDigest(int(entry["size"]), str(entry["sha256"]))
                for name, entry in body["files"].items()
            }
            named = AdapterRef(str(body["adapter_id"]), int(body["version"]))
            known_format = body["format"] == _FORMAT
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise AdapterLoadFailed(str(ref), f"its manifest is unreadable ({error})") from None
        if not known_format or named != ref:
            raise AdapterLoadFailed(str(ref), f"its manifest describes {named} (format {body['format']})")
        if any("/" in name or name.startswith(".") or name == MANIFEST_FILE for name in files):
            raise AdapterLoadFailed(str(ref), f"its manifest names unsafe files {sorted(files)}")
        return cls(ref, files)

    def contradiction(self, registered: RegisteredDigest) -> str | None:
        """How this manifest disagrees with what the registry recorded at upload; None if it agrees."""
        weights = self.files.get(WEIGHTS_FILE)
        if weights is None or weights.sha256 != registered.weights_sha256:
            return f"its {WEIGHTS_FILE} is not the one registered (sha256 differs)"
        size = sum(digest.size for digest in self.files.values())
        if size != registered.size_bytes:
            return f"its files hold {size} bytes, the registry recorded {registered.size_bytes}"
        return None

    def problems(self, directory: Path, names: Iterable[str] | None = None) -> list[str]:
        """How the files in `directory` (all, or those `names`) differ from this manifest: missing, wrong
        size, wrong sha256."""
        found = []
        for name in sorted(self.files if names is None else names):
            expected = self.files[name]
            path = directory / name
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                found.append(f"{name} is missing")
                continue
            if size != expected.size:
                found.append(f"{name} has {size} bytes, its manifest says {expected.size}")
            elif digest_file(path).sha256 != expected.sha256:
                found.append(f"{name} does not match the sha256 in its manifest")
        return found


def digest_file(path: Path) -> FileDigest:
    with path.open("rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
        return FileDigest(f.tell(), sha)


def content_key(manifest_bytes: bytes) -> str:
    """A short name for a version's exact content: the manifest covers every file's sha256."""
    return hashlib.sha256(manifest_bytes).hexdigest()[:16]
