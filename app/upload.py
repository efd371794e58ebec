"""Streaming multipart/form-data uploads: straight to disk, with the size limit enforced while receiving.

Starlette's `request.form()` cannot be used for adapter uploads: it parses the whole body before the
route sees any of it, with no limit on the total. Here every chunk is counted as it arrives
(413 the moment the total passes the limit, the rest never read), file parts go to fixed names in a
fresh temp dir, and any failure, a client disconnect included, removes that dir before the error leaves.

python-multipart's own guards are not enough on their own: `MultipartParser(max_size=...)` silently
truncates instead of failing, and `finalize()` does not check that the closing boundary was seen, so a
truncated body would look complete. Hence our own byte count and the `on_end` flag.
"""

import re
import shutil
import uuid
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from io import BufferedWriter
from pathlib import Path
from typing import TYPE_CHECKING

import anyio.to_thread
from python_multipart.exceptions import FormParserError, MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request

from app.errors import InvalidParameter, PayloadTooLarge

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

UPLOADS_DIR = "uploads"  # under data_dir: where uploads are received (swept at startup, app/bootstrap.py)
MAX_FIELD_BYTES = 4 * 1024
# File data is handed to a worker thread in batches of this size: disk writes (which can block for long
# under dirty-page throttling on multi-GB uploads) stay off the event loop, without a thread hop per chunk.
FLUSH_BYTES = 1024 * 1024
# Names used for files on disk; checked up front, since they come from the caller, not the client.
_SAFE_FIELD = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass
class UploadedFile:
    field: str
    filename: str  # client-supplied, sanitised to a basename; metadata only, never used as a path
    path: Path
    size: int
    content_type: str | None


@dataclass
class Upload:
    fields: dict[str, str]
    files: dict[str, UploadedFile]
    directory: Path

    def cleanup(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _mb(size: int) -> str:
    return f"{size / 2**20:.2f} MB"  # binary MB, as in Settings.max_upload_mb


def _too_large(message: str) -> PayloadTooLarge:
    return PayloadTooLarge(message, code="upload_too_large")


def _bad(message: str, code: str, param: str | None = None) -> InvalidParameter:
    return InvalidParameter(message, param=param, code=code)


def _malformed(detail: str = "") -> InvalidParameter:
    return _bad("malformed multipart body" + (f": {detail}" if detail else ""), "malformed_multipart")


def sanitise_filename(raw: str) -> str:
    """The basename of a client-supplied file name, without control characters (`.` and `..` give "")."""
    name = _CONTROL.sub("", raw).replace("\\", "/").rsplit("/", 1)[-1].strip()
    return "" if name in (".", "..") else name[:255]


def _decode(raw: bytes | bytearray, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _malformed(f"{what} is not valid UTF-8") from None


@dataclass
class _Part:
    name: str
    filename: str | None  # None: a plain text field
    content_type: str | None
    path: Path | None = None
    data: bytearray = field(default_factory=bytearray)  # text value, or file bytes not yet written
    size: int = 0
    done: bool = False
    closed: bool = False
    handle: BufferedWriter | None = None


class _Receiver:
    """python-multipart callbacks: parse headers and collect data; file I/O is left to `flush()`."""

    def __init__(
        self,
        directory: Path,
        allowed_file_fields: set[str],
        max_fields: int,
        on_data: Callable[[str, bytearray], None] | None = None,
        on_field: Callable[[str, str], None] | None = None,
    ) -> None:
        self.directory = directory
        self.on_data = on_data
        self.on_field = on_field
        self.allowed = allowed_file_fields
        self.max_fields = max_fields
        self.parts: list[_Part] = []
        self.names: set[str] = set()
        self.headers: dict[bytes, bytes] = {}
        self.header_name = bytearray()
        self.header_value = bytearray()
        self.fields: dict[str, str] = {}
        self.current: _Part | None = None
        self.ended = False

    def callbacks(self) -> "MultipartCallbacks":
        return {
            "on_part_begin": self.on_part_begin,
            "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value,
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
            "on_end": self.on_end,
        }

    def on_part_begin(self) -> None:
        # Counted at the start, so a flood of empty parts is refused before its headers are parsed.
        if len(self.parts) >= self.max_fields:
            raise _bad(f"Too many form fields: at most {self.max_fields} are accepted.", "too_many_fields")
        self.headers = {}

    # Header sizes and counts are bounded by the parser (max_header_size, max_header_count).
    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]

    def on_header_end(self) -> None:
        self.headers[bytes(self.header_name).lower()] = bytes(self.header_value)
        self.header_name.clear()
        self.header_value.clear()

    def on_headers_finished(self) -> None:
        disposition, options = parse_options_header(self.headers.get(b"content-disposition"))
        if disposition != b"form-data" or not options.get(b"name"):
            raise _malformed("every part needs `Content-Disposition: form-data` with a name")
        name = _decode(options[b"name"], "a field name")
        if name in self.names:
            raise _bad(f"Field '{name}' appears more than once.", "duplicate_field", name)
        self.names.add(name)
        # RFC 7578 forbids `filename*=`; python-multipart ignores it, so such a part arrives as a field.
        raw_filename = options.get(b"filename")
        content_type = self.headers.get(b"content-type")
        part = _Part(
            name,
            None if raw_filename is None else sanitise_filename(raw_filename.decode("utf-8", "replace")),
            None if content_type is None else content_type.decode("latin-1").strip(),
        )
        if part.filename is not None:
            if name not in self.allowed:
                expected = ", ".join(sorted(self.allowed)) or "none"
                raise _bad(f"Unexpected file field '{name}' (expected: {expected}).", "unexpected_file", name)
            part.path = self.directory / f"part-{name}"
        elif name in self.allowed:
            raise _bad(f"Field '{name}' must be sent as a file (with a filename).", "expected_file", name)
        self.parts.append(part)
        self.current = part

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        part = self.current
        assert part is not None
        part.size += end - start
        if part.filename is None and part.size > MAX_FIELD_BYTES:
            message = f"Field '{part.name}' is larger than {MAX_FIELD_BYTES} bytes."
            raise _bad(message, "field_too_large", part.name)
        part.data += data[start:end]

    def on_part_end(self) -> None:
        part = self.current
        assert part is not None
        part.done = True
        if part.path is None:  # decoded now, so a bad field fails before the files that follow it
            self.fields[part.name] = _decode(part.data, f"field '{part.name}'")
            if self.on_field is not None:
                self.on_field(part.name, self.fields[part.name])
        self.current = None

    def on_end(self) -> None:
        self.ended = True

    def needs_flush(self) -> bool:
        return any(self._due(part) for part in self.parts)

    @staticmethod
    def _due(part: _Part) -> bool:
        return part.path is not None and not part.closed and (part.done or len(part.data) >= FLUSH_BYTES)

    def flush(self) -> None:
        """Write out buffered file data, closing finished files; runs in a worker thread."""
        for part in filter(self._due, self.parts):
            assert part.path is not None
            if self.on_data is not None:  # checked before written: a refused part's bytes stop here
                self.on_data(part.name, part.data)
            if part.handle is None:
                part.handle = open(part.path, "xb")  # noqa: SIM115 - stays open across flushes
            part.handle.write(part.data)
            part.data.clear()
            if part.done:
                part.handle.close()
                part.closed = True

    def close_all(self) -> None:
        for part in self.parts:
            if part.handle is not None:
                part.handle.close()

    def upload(self) -> Upload:
        files = {
            p.name: UploadedFile(p.name, p.filename or "", p.path, p.size, p.content_type)
            for p in self.parts
            if p.path is not None
        }
        return Upload(self.fields, files, self.directory)


def _make_directory(directory: Path) -> None:
    directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # uploads are nobody else's to read
    directory.mkdir(mode=0o700)


def _boundary(request: Request) -> bytes:
    content_type, options = parse_options_header(request.headers.get("content-type"))
    boundary = options.get(b"boundary")
    if content_type != b"multipart/form-data" or not boundary:
        raise _bad(
            "Expected a multipart/form-data body with a boundary"
            f" (got Content-Type: {request.headers.get('content-type', 'none')!r}).",
            "invalid_content_type",
        )
    return boundary


async def receive_upload(
    request: Request,
    *,
    tmp_root: Path,
    max_bytes: int,
    max_fields: int = 16,
    allowed_file_fields: set[str],
    on_data: Callable[[str, bytearray], None] | None = None,
    on_field: Callable[[str, str], None] | None = None,
) -> Upload:
    """Receive a multipart/form-data body: text fields in memory (4 KiB each), files streamed to disk.

    `max_bytes` bounds the whole body as sent (multipart framing included). `max_fields` bounds the number
    of parts, files included. `on_data(field, data)` sees each file's bytes in order, in a worker thread
    (up to FLUSH_BYTES at a time, before they are written), and may refuse them by raising; `on_field(name,
    value)` sees each text field as it ends (on the event loop: cheap checks only), likewise. On success
    the caller owns `Upload.directory` and must call `cleanup()`; on any error (APIError,
    ClientDisconnect, cancellation) the directory is already gone.
    """
    unsafe = sorted(name for name in allowed_file_fields if not _SAFE_FIELD.match(name))
    if unsafe:
        raise ValueError(f"file field names must be safe file names: {unsafe}")
    boundary = _boundary(request)
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise _bad("Invalid Content-Length header.", "invalid_content_length")
        if int(declared) > max_bytes:
            raise _too_large(f"Upload of {_mb(int(declared))} exceeds the {_mb(max_bytes)} limit.")

    directory = tmp_root / uuid.uuid4().hex
    receiver = _Receiver(directory, allowed_file_fields, max_fields, on_data, on_field)
    try:
        parser = MultipartParser(boundary, receiver.callbacks())
    except FormParserError as error:  # e.g. a boundary over 256 bytes
        raise _bad(f"Invalid multipart/form-data boundary: {error}", "invalid_content_type") from None
    try:
        await anyio.to_thread.run_sync(_make_directory, directory)
        received = 0
        async with aclosing(request.stream()) as chunks:
            async for chunk in chunks:
                received += len(chunk)
                if received > max_bytes:
                    message = f"Upload exceeds the {_mb(max_bytes)} limit ({_mb(received)} received so far)."
                    raise _too_large(message)
                try:
                    parser.write(chunk)
                except MultipartParseError as error:
                    raise _malformed(str(error)) from None
                if receiver.needs_flush():
                    await anyio.to_thread.run_sync(receiver.flush)
        if not receiver.ended:
            raise _malformed("the body ended before the closing boundary")
        await anyio.to_thread.run_sync(receiver.flush)
        return receiver.upload()
    except BaseException:
        # Sync on purpose: this must also run when the task is being cancelled.
        receiver.close_all()
        shutil.rmtree(directory, ignore_errors=True)
        raise
