"""extract_adapter_archive: unpack an uploaded PEFT adapter archive (.tar.gz, .tgz, .zip) as hostile input.

Every member is checked before it is written, and sizes are counted on the bytes actually written, since
headers can lie. Extraction streams member by member in chunks and writes only regular files and directories,
with fixed permissions, through O_EXCL|O_NOFOLLOW opens under a destination that holds nothing else. Once a
problem is found nothing more is written, but the remaining headers are still read so that the refusal lists
every problem; on any refusal (or any other error) the destination is emptied again.
"""

import gzip
import os
import re
import shutil
import stat
import struct
import tarfile
import unicodedata
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal, Self

from adapters.errors import AdapterInvalid
from adapters.spec import CONFIG_FILE, WEIGHTS_FILE
from adapters.zip_directory import ZipDirectory

_CHUNK = 1024 * 1024
# Tar metadata read between two members' data (ustar/pax/GNU headers, block padding) and the zero padding
# after the end marker. Real headers are a few KiB; tarfile reads pax and GNU long-name headers into memory
# whole, so an oversized one is a memory bomb. The slack covers tarfile's 10 KiB read-ahead.
_TAR_HEADER_ALLOWANCE = 64 * 1024
_TAR_TRAILER_ALLOWANCE = 1024 * 1024  # GNU tar pads the end to its record size (10 KiB by default)
_MAX_NAME_BYTES = 1024
_MAX_PART_BYTES = 255  # NAME_MAX
# Central directory bytes allowed per member: the fixed 46-byte header, the longest name accepted, and room
# for extra fields and a comment (real zips use a few dozen bytes of extras).
_ZIP_ENTRY_ALLOWANCE = 46 + _MAX_NAME_BYTES + 2048
_PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib"})
_CODE_SUFFIXES = frozenset({".py", ".pyc", ".pyo", ".pyd", ".so", ".dylib", ".dll"})
_DRIVE = re.compile(r"[A-Za-z]:")
_SIGNATURES: tuple[tuple[str, int, bytes], ...] = (
    ("a gzip stream", 0, b"\x1f\x8b"),
    ("a zip archive", 0, b"PK\x03\x04"),
    ("a zip archive", 0, b"PK\x05\x06"),  # empty zip: refused later as empty
    ("an uncompressed tar archive", 257, b"ustar"),
    ("a bzip2 stream", 0, b"BZh"),
    ("an xz stream", 0, b"\xfd7zXZ\x00"),
    ("a zstd stream", 0, b"\x28\xb5\x2f\xfd"),
    ("a rar archive", 0, b"Rar!\x1a\x07"),
    ("a 7z archive", 0, b"7z\xbc\xaf\x27\x1c"),
)
_TAR_CORRUPT = (tarfile.TarError, gzip.BadGzipFile, EOFError, zlib.error)
# zipfile reports malformed structures through several exception types; ValueError includes bad UTF-8 names.
_ZIP_CORRUPT = (zipfile.BadZipFile, EOFError, zlib.error, struct.error, ValueError, NotImplementedError)

_Kind = Literal["tar.gz", "zip"]


@dataclass(frozen=True)
class ArchiveLimits:
    max_files: int = 16  # members, directories included
    max_total_bytes: int = 2 * 1024**3  # uncompressed, all members
    max_member_bytes: int = 2 * 1024**3
    max_ratio: float = 200.0  # uncompressed / compressed size, for the whole archive (zip bombs)


def extract_adapter_archive(
    archive: Path, dest: Path, *, filename: str, limits: ArchiveLimits = ArchiveLimits()
) -> Path:
    """Extract a PEFT adapter archive into `dest` (must be empty or missing) and return the directory that
    holds adapter_config.json (the archive root, or its single top-level folder). The archive type comes from
    `filename`'s suffix (.tar.gz, .tgz, .zip), confirmed by the file's magic bytes (a .zip that is really a
    tar is refused).

    Raises AdapterInvalid listing every problem found, leaving `dest` existing and empty. A non-empty `dest`
    is the caller's mistake: ValueError, and `dest` is left alone.
    """
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise ValueError(f"extraction destination {dest} is not empty")
    try:
        kind = _kind_from_suffix(filename)
        _check_magic(archive, kind, filename)
        extraction = _Extraction(dest, limits, archive.stat().st_size)
        if kind == "zip":
            _extract_zip(archive, extraction, filename)
        else:
            _extract_tar(archive, extraction, filename)
        return extraction.finish()
    except BaseException:
        _empty(dest)
        raise


class _Refused(Exception):
    """A problem that ends extraction at once (a limit passed mid-stream); the message is the problem."""


def _show(name: str) -> str:
    """A member name fit for a message: as is when printable, repr'd when it holds control characters."""
    return name if name.isprintable() else repr(name)


def _kind_from_suffix(filename: str) -> _Kind:
    lower = filename.lower()
    if lower.endswith((".tar.gz", ".tgz")):
        return "tar.gz"
    if lower.endswith(".zip"):
        return "zip"
    raise AdapterInvalid([f"unsupported archive type: {_show(filename)} (upload a .tar.gz, .tgz or .zip)"])


def _check_magic(archive: Path, kind: _Kind, filename: str) -> None:
    with archive.open("rb") as f:
        head = f.read(512)
    found = next((what for what, at, magic in _SIGNATURES if head[at : at + len(magic)] == magic), None)
    expected = "a gzip stream" if kind == "tar.gz" else "a zip archive"
    if found != expected:
        content = found or "not a recognised archive format"
        raise AdapterInvalid(
            [f"{_show(filename)} is not {expected} as its name says: its content is {content}"]
        )


def _empty(dest: Path) -> None:
    for child in dest.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def _split_name(name: str, *, is_dir: bool) -> tuple[tuple[str, ...], list[str]]:
    """The path parts of a member name ('.' and empty parts dropped), and why the name is refused if it is."""
    shown = _show(name)
    problems: list[str] = []
    if "\x00" in name:
        problems.append(f"NUL bytes in member names are refused: {shown}")
    elif not name.isprintable():  # also catches surrogates, which tarfile uses for undecodable bytes
        problems.append(f"control or non-printable characters in member names are refused: {shown}")
    if "\\" in name:
        problems.append(f"backslashes in member names are refused (Windows path tricks): {shown}")
    if name.startswith("/"):
        problems.append(f"absolute paths are refused: {shown}")
    parts = tuple(part for part in name.split("/") if part not in ("", "."))
    if any(_DRIVE.match(part) for part in parts):
        problems.append(f"Windows drive letters are refused: {shown}")
    if ".." in parts:
        problems.append(f"'..' path components are refused (path traversal): {shown}")
    sizes = [len(part.encode("utf-8", "surrogateescape")) for part in parts]
    if sum(sizes) + len(sizes) > _MAX_NAME_BYTES or any(size > _MAX_PART_BYTES for size in sizes):
        problems.append(f"member name too long: {shown[:100]}...")
    if not parts and not is_dir and not problems:
        problems.append(f"a file member has no name: {shown}")
    return parts, problems


def _suffix_problems(parts: tuple[str, ...], shown: str) -> list[str]:
    suffix = Path(parts[-1]).suffix.lower() if parts else ""
    if suffix in _PICKLE_SUFFIXES:
        return [f"pickle files are refused, never unpickled: {shown}"]
    if suffix in _CODE_SUFFIXES:
        return [f"code files are refused: {shown}"]
    return []


def _key(parts: tuple[str, ...]) -> str:
    # Folded so that names one filesystem would merge (case, Unicode normal form) count as duplicates.
    return unicodedata.normalize("NFC", "/".join(parts)).casefold()


class _Extraction:
    """Checks members as they come, writes them while no problem is known, and finds the adapter root."""

    def __init__(self, dest: Path, limits: ArchiveLimits, archive_size: int) -> None:
        self.dest = dest
        self.real_dest = os.path.realpath(dest)
        self.limits = limits
        self.archive_size = archive_size
        self.problems: list[str] = []
        self.stopped = False  # too many members: the rest were not read
        self._members = 0
        self._declared = 0
        self._declared_reported = False
        self._written = 0
        self._names: dict[str, str] = {}  # folded path -> the first member name that used it
        self._file_keys: set[str] = set()
        self._dir_keys: set[str] = set()  # explicit and implied directories
        self._files: set[tuple[str, ...]] = set()
        self._root_files = False
        self._top_dirs: set[str] = set()

    def admit(self, name: str, *, is_dir: bool, size: int, refusals: list[str]) -> tuple[str, ...] | None:
        """Check one member's header; return its path parts if it is to be written now, else None."""
        self._members += 1
        if self._members > self.limits.max_files:
            self.problems.append(
                f"too many members: more than {self.limits.max_files} (directories included)"
            )
            self.stopped = True
            return None
        shown = _show(name) if name else f"(member {self._members})"
        problems = list(refusals)
        if not name:
            parts: tuple[str, ...] = ()
            problems.append(f"empty member names are refused: {shown}")
        else:
            parts, name_problems = _split_name(name, is_dir=is_dir)
            problems += name_problems
            if not name_problems and parts:
                problems += self._placement_problems(parts, shown, is_dir=is_dir)
        if size < 0:
            problems.append(f"invalid member size {size}: {shown}")
        if not is_dir:
            problems += _suffix_problems(parts, shown)
            if size > self.limits.max_member_bytes:
                problems.append(
                    f"member too large: {shown} declares {size} bytes, "
                    f"more than max_member_bytes={self.limits.max_member_bytes}"
                )
            self._declared += max(size, 0)
            self._check_declared_totals()
        self.problems += problems
        if self.problems or not parts:  # nothing is written once the archive is known to be refused
            return None
        return parts

    def _placement_problems(self, parts: tuple[str, ...], shown: str, *, is_dir: bool) -> list[str]:
        problems: list[str] = []
        key = _key(parts)
        if key in self._names:
            problems.append(
                f"duplicate member name: {shown} (same as {self._names[key]} after normalisation)"
            )
        else:
            self._names[key] = shown
        parents = [_key(parts[:i]) for i in range(1, len(parts))]
        if any(parent in self._file_keys for parent in parents):
            problems.append(f"member inside a path that is a file: {shown}")
        if not is_dir and key in self._dir_keys:
            problems.append(f"file name already used as a directory: {shown}")
        self._dir_keys.update(parents)
        if is_dir:
            self._dir_keys.add(key)
        else:
            self._file_keys.add(key)
            self._files.add(parts)
        if len(parts) == 1 and not is_dir:
            self._root_files = True
        else:
            self._top_dirs.add(parts[0])
        return problems

    def _check_declared_totals(self) -> None:
        if self._declared_reported:
            return
        if self._declared > self.limits.max_total_bytes:
            self._declared_reported = True
            self.problems.append(
                f"total size too large: members declare more than "
                f"max_total_bytes={self.limits.max_total_bytes} bytes uncompressed"
            )
        elif self._declared > self.limits.max_ratio * self.archive_size:
            self._declared_reported = True
            self.problems.append(
                f"compression ratio too high: members declare {self._declared} bytes from a "
                f"{self.archive_size}-byte archive, more than {self.limits.max_ratio:g}x "
                "(a decompression bomb?)"
            )

    def make_dir(self, parts: tuple[str, ...], shown: str) -> None:
        target = self.dest.joinpath(*parts)
        self._check_inside(target, shown)
        target.mkdir(mode=0o700, parents=True, exist_ok=True)

    def write(self, parts: tuple[str, ...], source: IO[bytes], *, declared: int, shown: str) -> None:
        """Copy `source` in chunks, counting what is written against the limits rather than the header."""
        target = self.dest.joinpath(*parts)
        self._check_inside(target, shown)
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # O_EXCL: never through a link or over an earlier member; owner-only, whatever the archive says.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        written = 0
        with os.fdopen(os.open(target, flags, 0o600), "wb") as out:
            while chunk := source.read(_CHUNK):
                written += len(chunk)
                self._written += len(chunk)
                self._check_written(shown, written, declared)
                out.write(chunk)
        if written != declared:
            raise _Refused(f"{shown} holds {written} bytes but its header declares {declared}")

    def _check_written(self, shown: str, written: int, declared: int) -> None:
        limits = self.limits
        if written > limits.max_member_bytes:
            raise _Refused(
                f"member too large: {shown} holds more than max_member_bytes={limits.max_member_bytes}"
            )
        if self._written > limits.max_total_bytes:
            raise _Refused(
                f"total size too large: more than max_total_bytes={limits.max_total_bytes} bytes "
                f"uncompressed (reached in {shown})"
            )
        if self._written > limits.max_ratio * self.archive_size:
            raise _Refused(
                f"compression ratio too high: more than {limits.max_ratio:g}x the {self.archive_size}-byte "
                f"archive extracted (reached in {shown}; a decompression bomb?)"
            )
        if written > declared:
            raise _Refused(f"{shown} holds more data than its header declares ({declared} bytes)")

    def _check_inside(self, path: Path, shown: str) -> None:
        # Unreachable with the name checks above; kept in case one of them is ever loosened. Checked before
        # any directory is made: realpath resolves existing links and '..' in the parts that do not exist yet.
        real = os.path.realpath(path)
        if real != self.real_dest and not real.startswith(self.real_dest + os.sep):
            raise _Refused(f"member would be written outside the destination: {shown}")

    def fail(self, problem: str) -> AdapterInvalid:
        """The refusal for a problem that ended extraction, unless its kind ("total size too large", ...) was
        already reported from the headers."""
        kind = problem.split(":", 1)[0] + ":"
        if any(known.startswith(kind) for known in self.problems):
            return AdapterInvalid(self.problems)
        return AdapterInvalid([*self.problems, problem])

    def finish(self) -> Path:
        """The adapter root, or AdapterInvalid with every problem found."""
        root = None if self.stopped else self._adapter_root()
        if self.problems or root is None:
            raise AdapterInvalid(self.problems)
        return self.dest.joinpath(*root)

    def _adapter_root(self) -> tuple[str, ...] | None:
        if self._root_files:
            root: tuple[str, ...] = ()
        elif len(self._top_dirs) == 1:
            root = (next(iter(self._top_dirs)),)
        elif self._top_dirs:
            folders = ", ".join(sorted(_show(d) for d in self._top_dirs))
            self.problems.append(
                f"several top-level folders ({folders}): put the adapter files at the archive root "
                "or in a single folder"
            )
            return None
        else:
            self.problems.append("the archive holds no files")
            return None
        missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if (*root, name) not in self._files]
        if missing:
            where = f"folder {_show(root[0])}/" if root else "the archive root"
            self.problems.append(f"missing {', '.join(missing)} in {where}")
        return root


class _MeteredStream:
    """The decompressed tar stream as tarfile reads it, refused past `cap` bytes in all, or past the end of
    the current window: the metadata tarfile reads between members, which it may hold in memory whole."""

    def __init__(self, source: gzip.GzipFile, cap: int, cap_problem: str) -> None:
        self._source = source
        self._cap = cap
        self._cap_problem = cap_problem
        self._count = 0
        self._window_end: int | None = None
        self._window_what = ""

    def window(self, allowance: int | None, what: str = "") -> None:
        self._window_end = None if allowance is None else self._count + allowance
        self._window_what = what

    def read(self, size: int = -1, /) -> bytes:
        data = self._source.read(_CHUNK if size < 0 else min(size, _CHUNK))
        self._count += len(data)
        if self._count > self._cap:
            raise _Refused(self._cap_problem)
        if self._window_end is not None and self._count > self._window_end:
            raise _Refused(f"oversized tar metadata {self._window_what} (a pax/GNU header or padding bomb?)")
        return data

    def write(self, b: bytes, /) -> int:
        raise OSError("read-only stream")

    def tell(self) -> int:
        return self._count

    def seek(self, pos: int, /) -> int:
        raise OSError("unseekable stream")

    def close(self) -> None:
        pass  # the caller owns the source


class _StrictTarInfo(tarfile.TarInfo):
    """tarfile silently ends an archive at a missing, truncated or invalid header after the first member,
    hiding truncation and headers that misstate a member's size: here only the real end marker ends it."""

    @classmethod
    def fromtarfile(cls, tarfile_: tarfile.TarFile) -> Self:
        try:
            return super().fromtarfile(tarfile_)
        except tarfile.HeaderError as exc:
            if isinstance(exc, tarfile.EOFHeaderError):  # type: ignore[attr-defined]  # zero block: the end
                raise
            raise tarfile.ReadError(
                f"bad tar header ({exc}): the archive is truncated or a member's header misstates its size"
            ) from None


def _round_block(size: int) -> int:
    return -(-max(size, 0) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def _tar_refusals(member: tarfile.TarInfo) -> list[str]:
    shown = _show(member.name)
    if member.issym():
        return [f"symlinks are refused: {shown} -> {_show(member.linkname)}"]
    if member.islnk():
        return [f"hardlinks are refused: {shown} -> {_show(member.linkname)}"]
    if member.ischr() or member.isblk():
        return [f"device files are refused: {shown}"]
    if member.isfifo():
        return [f"FIFOs are refused: {shown}"]
    if member.issparse():
        return [f"sparse files are refused: {shown}"]
    if member.isreg() or member.isdir():
        return []
    return [f"only regular files and directories are allowed: {shown} has tar type {member.type!r}"]


def _extract_tar(archive: Path, ex: _Extraction, filename: str) -> None:
    limits = ex.limits
    ratio_bound = limits.max_ratio * ex.archive_size
    if ratio_bound < limits.max_total_bytes:
        cap_problem = (
            f"compression ratio too high: the archive expands past {limits.max_ratio:g}x its "
            f"{ex.archive_size} bytes (a decompression bomb?)"
        )
    else:
        cap_problem = (
            f"total size too large: the archive expands past max_total_bytes={limits.max_total_bytes}"
        )
    # The members' bytes are limited by the checks on each member; this bounds the rest of the stream.
    cap = int(min(ratio_bound, limits.max_total_bytes))
    cap += (limits.max_files + 1) * _TAR_HEADER_ALLOWANCE + _TAR_TRAILER_ALLOWANCE
    try:
        with archive.open("rb") as raw, gzip.GzipFile(fileobj=raw, mode="rb") as gz:
            stream = _MeteredStream(gz, cap, cap_problem)
            stream.window(_TAR_HEADER_ALLOWANCE, "before the first member")
            with tarfile.open(fileobj=stream, mode="r|", tarinfo=_StrictTarInfo) as tar:
                while (member := tar.next()) is not None:
                    stream.window(None)
                    unread = _round_block(member.size)
                    unread -= _admit_tar_member(tar, member, ex)
                    if ex.stopped:
                        return
                    stream.window(unread + _TAR_HEADER_ALLOWANCE, f"after {_show(member.name)}")
                # Read to the end: only zeros may follow the end marker, and gzip checks its CRC there.
                stream.window(_TAR_TRAILER_ALLOWANCE, "after the end-of-archive marker")
                while chunk := tar.fileobj.read(_CHUNK):
                    if chunk.strip(b"\0"):
                        ex.problems.append(
                            "data after the tar end-of-archive marker (a member's header may understate "
                            "its size)"
                        )
                        break
    except _Refused as exc:
        raise ex.fail(str(exc)) from None
    except _TAR_CORRUPT as exc:
        raise ex.fail(f"{_show(filename)}: corrupt or truncated archive ({exc})") from None


def _admit_tar_member(tar: tarfile.TarFile, member: tarfile.TarInfo, ex: _Extraction) -> int:
    """Check one tar member and write it if allowed; return how many of its data bytes were read."""
    shown = _show(member.name)
    parts = ex.admit(member.name, is_dir=member.isdir(), size=member.size, refusals=_tar_refusals(member))
    if parts is None:
        return 0
    try:  # second line of defence: what tarfile itself would refuse to extract with filter="data"
        tarfile.data_filter(member, ex.real_dest)
    except tarfile.FilterError as exc:
        ex.problems.append(f"refused by tarfile's data filter: {shown} ({exc})")
        return 0
    if member.isdir():
        ex.make_dir(parts, shown)
        return 0
    source = tar.extractfile(member)
    if source is None:  # unreachable: only regular files get here
        raise _Refused(f"cannot read {shown}")
    with source:
        ex.write(parts, source, declared=member.size, shown=shown)
    return member.size


def _zip_refusals(info: zipfile.ZipInfo) -> list[str]:
    shown = _show(info.filename)
    problems: list[str] = []
    if "\x00" in info.orig_filename:  # zipfile cuts names at the first NUL; the raw name shows it
        problems.append(f"NUL bytes in member names are refused: {_show(info.orig_filename)}")
    if info.flag_bits & 0x1:
        problems.append(f"encrypted members are refused: {shown}")
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        problems.append(f"unsupported compression method {info.compress_type} (use deflate): {shown}")
    # Unix zips keep st_mode in the high 16 bits; extractors that honour it would create links or devices.
    file_type = stat.S_IFMT(info.external_attr >> 16)
    named_dir = info.filename.endswith("/")
    if file_type == stat.S_IFLNK:
        problems.append(f"symlinks are refused: {shown}")
    elif file_type in (stat.S_IFCHR, stat.S_IFBLK):
        problems.append(f"device files are refused: {shown}")
    elif file_type == stat.S_IFIFO:
        problems.append(f"FIFOs are refused: {shown}")
    elif file_type not in (0, stat.S_IFREG, stat.S_IFDIR) or (file_type == stat.S_IFDIR and not named_dir):
        problems.append(f"only regular files and directories are allowed: {shown} has mode {file_type:#o}")
    if named_dir and info.file_size:
        problems.append(f"directory entries must not hold data: {shown}")
    return problems


def _zip_directory_problems(archive: Path, limits: ArchiveLimits) -> list[str]:
    """Refusals from the end records alone, before zipfile reads the central directory into memory."""
    directory = ZipDirectory.read(archive)
    if directory is None:
        return []  # no end record: zipfile raises BadZipFile without reading a directory
    problems = []
    if directory.entries > limits.max_files:
        problems.append(f"too many members: more than {limits.max_files} (directories included)")
    if directory.size > limits.max_files * _ZIP_ENTRY_ALLOWANCE:
        problems.append(
            f"zip central directory too large: {directory.size} bytes for at most {limits.max_files} members"
        )
    return problems


def _extract_zip(archive: Path, ex: _Extraction, filename: str) -> None:
    refusals = _zip_directory_problems(archive, ex.limits)
    if refusals:
        ex.problems += refusals
        ex.stopped = True
        return
    try:
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                is_dir = info.filename.endswith("/")
                parts = ex.admit(
                    info.filename, is_dir=is_dir, size=info.file_size, refusals=_zip_refusals(info)
                )
                if ex.stopped:
                    return
                if parts is None:
                    continue
                shown = _show(info.filename)
                if is_dir:
                    ex.make_dir(parts, shown)
                    continue
                with zf.open(info) as source:
                    ex.write(parts, source, declared=info.file_size, shown=shown)
    except _Refused as exc:
        raise ex.fail(str(exc)) from None
    except _ZIP_CORRUPT as exc:
        raise ex.fail(f"{_show(filename)}: corrupt or truncated archive ({exc})") from None
