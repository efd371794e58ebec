"""`loraplex adapters`: upload PEFT LoRA adapters to a deployment, list and show them, pin and delete them.

Uploads are streamed: the multipart/form-data body is produced chunk by chunk from the files on disk
(`MultipartBody`), so a multi-GB adapter never sits in memory, and a progress bar on stderr counts the
bytes sent. Everything else goes through the shared admin client (app.cli.common).
"""

import os
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated
from urllib.parse import urlencode

import httpx
import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from app.cli.common import (
    EXIT_USAGE,
    JSON,
    URL_HINT,
    admin_client,
    confirmed_delete,
    emit,
    fail,
    fail_from_response,
    options,
    segment,
    stdout,
)
from app.cli.output import cells, fmt_time, record, table

adapters_app = typer.Typer(
    help="LoRA adapters: upload (PEFT directory or archive), list, show, pin, delete.", no_args_is_help=True
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".zip")
# As refused by the platform (adapters.validation / adapters.archive); not imported: that pulls in torch.
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib"})
CHUNK_SIZE = 256 * 1024
# Sending has no overall limit (each write gets 60 s); the platform then validates the whole adapter
# (hashing, every tensor checked against the base model) before it answers.
UPLOAD_TIMEOUT = httpx.Timeout(60.0, read=600.0)
_SHA_PREFIX = 12


# --- streamed multipart body -------------------------------------------------------------------------


@dataclass(frozen=True)
class FilePart:
    """One file of a multipart body: form field, file on disk, file name sent, content type."""

    field: str
    path: Path
    filename: str
    content_type: str = "application/octet-stream"


class SourceChanged(Exception):
    """A file changed size while it was being uploaded: the declared Content-Length no longer holds."""


class MultipartBody:
    """A multipart/form-data body that is never held in memory: `chunks()` yields it piece by piece.

    File sizes are taken when the body is made, so `length` (the Content-Length) is known before sending;
    a file that changes size meanwhile raises SourceChanged instead of sending a body of another length.
    """

    def __init__(
        self,
        fields: dict[str, str],
        files: list[FilePart],
        *,
        boundary: str | None = None,
        chunk_size: int = CHUNK_SIZE,
    ) -> None:
        self.boundary = boundary or secrets.token_hex(16)
        self.chunk_size = chunk_size
        self._fields = [(self._head(name), value.encode()) for name, value in fields.items()]
        self._files = [(self._head(f.field, f.filename, f.content_type), f) for f in files]
        self._sizes = {f.path: f.path.stat().st_size for f in files}
        self._tail = f"--{self.boundary}--\r\n".encode()
        self.length = (
            sum(len(head) + len(value) + 2 for head, value in self._fields)
            + sum(len(head) + self._sizes[f.path] + 2 for head, f in self._files)
            + len(self._tail)
        )

    @property
    def content_type(self) -> str:
        return f"multipart/form-data; boundary={self.boundary}"

    def chunks(self, sent: Callable[[int], None] | None = None) -> Iterator[bytes]:
        """The encoded body; `sent(n)` is called after each chunk of n bytes has been taken by the sender."""
        for head, value in self._fields:
            yield from _counted(sent, head + value + b"\r\n")
        for head, part in self._files:
            yield from _counted(sent, head)
            yield from self._file_chunks(part.path, sent)
            yield from _counted(sent, b"\r\n")
        yield from _counted(sent, self._tail)

    def _file_chunks(self, path: Path, sent: Callable[[int], None] | None) -> Iterator[bytes]:
        left = self._sizes[path]
        with path.open("rb") as file:
            while left > 0:
                chunk = file.read(min(self.chunk_size, left))
                if not chunk:
                    raise SourceChanged(f"{path} shrank while it was being uploaded")
                left -= len(chunk)
                yield from _counted(sent, chunk)
            if file.read(1):
                raise SourceChanged(f"{path} grew while it was being uploaded")

    def _head(self, name: str, filename: str | None = None, content_type: str | None = None) -> bytes:
        disposition = f'form-data; name="{_param(name)}"'
        if filename is not None:
            disposition += f'; filename="{_param(filename)}"'
        lines = [f"--{self.boundary}", f"Content-Disposition: {disposition}"]
        if content_type is not None:
            lines.append(f"Content-Type: {content_type}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _counted(sent: Callable[[int], None] | None, chunk: bytes) -> Iterator[bytes]:
    yield chunk
    if sent is not None:
        sent(len(chunk))


def _param(value: str) -> str:
    """A header parameter value: quotes and control characters percent-encoded (as browsers and httpx do)."""
    return "".join(f"%{ord(c):02X}" if c == '"' or ord(c) < 0x20 or ord(c) == 0x7F else c for c in value)


# --- upload ------------------------------------------------------------------------------------------------


def adapter_files(source: Path) -> list[FilePart]:
    """The file parts for a PEFT adapter directory or an archive; exits 2 (nothing sent) if it is unusable."""
    if source.is_dir():
        return _directory_files(source)
    if not source.exists():
        fail(f"{source}: no such file or directory", code=EXIT_USAGE)
    if not source.name.lower().endswith(ARCHIVE_SUFFIXES):
        fail(
            f"{source} is neither a directory nor a .tar.gz, .tgz or .zip archive",
            code=EXIT_USAGE,
            hint=f"give a PEFT adapter directory ({CONFIG_FILE} + {WEIGHTS_FILE}) or an archive of one",
        )
    kind = "application/zip" if source.name.lower().endswith(".zip") else "application/gzip"
    return [FilePart("file", source, source.name, kind)]


def _directory_files(directory: Path) -> list[FilePart]:
    try:
        names = sorted(entry.name for entry in os.scandir(directory))
    except OSError as exc:
        fail(f"cannot read {directory}: {exc.strerror or exc}", code=EXIT_USAGE)
    pickles = [name for name in names if Path(name).suffix.lower() in PICKLE_SUFFIXES]
    if pickles:
        fail(
            f"{directory} contains pickle-format files ({', '.join(pickles)}); the platform refuses them "
            "too (pickles are never unpickled there): nothing was uploaded",
            code=EXIT_USAGE,
            hint=f"save the weights as {WEIGHTS_FILE} (PEFT: save_pretrained(..., safe_serialization=True)) "
            "and move other files out of the directory",
        )
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (directory / name).is_file()]
    if missing:
        fail(
            f"{directory} is not a PEFT adapter directory: {' and '.join(missing)} missing",
            code=EXIT_USAGE,
            hint=f"a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE} (from save_pretrained)",
        )
    return [
        FilePart("adapter_config", directory / CONFIG_FILE, CONFIG_FILE, "application/json"),
        FilePart("adapter_model", directory / WEIGHTS_FILE, WEIGHTS_FILE),
    ]


@adapters_app.command("upload")
def adapters_upload(
    ctx: typer.Context,
    source: Annotated[
        Path,
        typer.Argument(
            metavar="DIR",
            help=f"PEFT adapter directory ({CONFIG_FILE} + {WEIGHTS_FILE}), or a .tar.gz/.tgz/.zip of one.",
            show_default=False,
        ),
    ],
    name: Annotated[
        str, typer.Option("--name", help="Adapter name, used as `model` in requests.", show_default=False)
    ],
    owner: Annotated[
        str,
        typer.Option(
            "--owner", help='Tenant ID that owns it, or "public" for every tenant.', show_default=False
        ),
    ],
    base_model: Annotated[
        str | None,
        typer.Option(
            "--base-model",
            help="Base model it was trained on; default: the only one served.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Upload an adapter, streamed, with a progress bar; re-uploading a name of an owner adds a version.

    The platform checks the config and every tensor against the base model, then serves it at once.
    """
    files = adapter_files(source)  # before any request: a bad DIR is refused locally
    fields = {"name": name, "owner": owner} | ({"base_model": base_model} if base_model else {})
    admin_client(ctx)  # exits if no admin key is given or the URL is invalid
    try:
        body = MultipartBody(fields, files)
    except OSError as exc:
        fail(f"cannot read {source}: {exc.strerror or exc}", code=EXIT_USAGE)
    adapter = _send(options(ctx).url, options(ctx).admin_key or "", body, label=source.resolve().name)
    emit(ctx, adapter, _print_uploaded)


def _send(url: str, admin_key: str, body: MultipartBody, *, label: str) -> JSON:
    """POST the body to /admin/adapters with a progress bar on stderr; the created adapter, or exit."""
    headers = {
        "authorization": f"Bearer {admin_key}",
        "content-type": body.content_type,
        "content-length": str(body.length),  # known up front: no chunked encoding
    }
    outcome: httpx.Response | httpx.HTTPError | SourceChanged | OSError
    sent_bytes = 0
    with (
        _progress() as progress,
        httpx.Client(base_url=url, timeout=UPLOAD_TIMEOUT) as http,
    ):
        task = progress.add_task(f"uploading {label}", total=body.length)

        def sent(size: int) -> None:
            nonlocal sent_bytes
            sent_bytes += size
            progress.update(task, completed=sent_bytes)
            if sent_bytes >= body.length:
                progress.update(task, description="sent; the platform is validating it")

        try:
            outcome = http.post("/admin/adapters", content=body.chunks(sent), headers=headers)
        except (httpx.HTTPError, SourceChanged, OSError) as exc:
            outcome = exc
        done = isinstance(outcome, httpx.Response) and not outcome.is_error
        progress.update(task, description=f"uploaded {label}" if done else f"upload of {label} failed")
    return _answer(url, outcome, sent=sent_bytes, total=body.length)


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True, highlight=False),
    )


def _answer(
    url: str, outcome: httpx.Response | httpx.HTTPError | SourceChanged | OSError, *, sent: int, total: int
) -> JSON:
    if isinstance(outcome, SourceChanged):
        fail(f"{outcome}; nothing was stored", code=EXIT_USAGE, hint="upload it again once it is complete")
    if isinstance(outcome, OSError):
        fail(f"cannot read the adapter while uploading: {outcome.strerror or outcome}", code=EXIT_USAGE)
    if isinstance(outcome, httpx.ConnectError | httpx.ConnectTimeout):
        fail(f"cannot reach {url}: is the platform running? (set --url or LORAPLEX_URL)", code=EXIT_USAGE)
    if isinstance(outcome, httpx.InvalidURL | httpx.UnsupportedProtocol):
        fail(f"invalid platform URL {url!r}: {outcome}", code=EXIT_USAGE, hint=URL_HINT)
    if isinstance(outcome, httpx.ReadTimeout) and sent >= total:
        fail(
            f"sent the adapter to {url}, but no answer came within {UPLOAD_TIMEOUT.read:.0f} s",
            code=EXIT_USAGE,
            hint="it may still be stored: check with `loraplex adapters list`",
        )
    if isinstance(outcome, httpx.HTTPError):
        fail(
            f"upload to {url} failed after {_size(sent)} of {_size(total)}: "
            f"{outcome or type(outcome).__name__}",
            code=EXIT_USAGE,
            hint="the platform cuts off uploads over its size limit (LORAPLEX_MAX_UPLOAD_MB)",
        )
    if outcome.is_error:
        fail_from_response(outcome)
    try:
        payload = outcome.json()
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        fail(
            f"unexpected answer from {url}/admin/adapters: not a JSON object (is --url a loraplex platform?)"
        )
    return payload


def _print_uploaded(adapter: JSON) -> None:
    console = stdout()
    console.print(
        record(
            "Uploaded adapter",
            [
                ("id", adapter.get("id")),
                ("name", adapter.get("name")),
                ("version", adapter.get("version")),
                ("owner", adapter.get("owner")),
                ("base_model", adapter.get("base_model")),
                ("rank", adapter.get("rank")),
                ("targets", _targets(adapter)),
                ("sha256", _sha(adapter.get("sha256"))),
                ("size", _size(adapter.get("size_bytes"))),
            ],
            pad_edge=False,
        )
    )
    who = "every tenant" if adapter.get("owner") == "public" else f"tenant {adapter.get('owner')}"
    console.print(
        f"Serving now: {who} calls it with model={adapter.get('model')!r}; new requests use "
        f"version {adapter.get('version')}.",
        markup=False,
    )


# --- list, get -----------------------------------------------------------------------------------------


@adapters_app.command("list")
def adapters_list(
    ctx: typer.Context,
    owner: Annotated[
        str | None, typer.Option("--owner", help='Only this tenant\'s (or "public").', show_default=False)
    ] = None,
    base_model: Annotated[
        str | None, typer.Option("--base-model", help="Only adapters of this base model.", show_default=False)
    ] = None,
    include_deleted: Annotated[bool, typer.Option("--all", help="Include deleted adapters.")] = False,
) -> None:
    """List adapters with their newest version (deleted ones only with --all)."""
    query = {
        key: value for key, value in (("owner", owner), ("base_model", base_model)) if value is not None
    } | ({"include_deleted": "true"} if include_deleted else {})
    path = "/admin/adapters" + (f"?{urlencode(query)}" if query else "")
    filtered = bool(owner or base_model)
    emit(ctx, admin_client(ctx).get(path), lambda listing: _print_adapters(listing, filtered=filtered))


def _print_adapters(listing: JSON, *, filtered: bool) -> None:
    adapters: list[JSON] = listing.get("data", [])
    if not adapters:
        upload = "loraplex adapters upload DIR --name NAME --owner TENANT_ID"
        message = "No adapters match." if filtered else f"No adapters yet: upload one with `{upload}`."
        stdout().print(message, markup=False)
        return
    rows = table("ID", "NAME", "OWNER", "BASE MODEL", "VER", "RANK", "STATUS", min_width=8)
    for a in adapters:
        status = "pinned" if a.get("pinned") and a.get("status") == "ready" else a.get("status")
        rows.add_row(
            *cells(
                a.get("id"),
                a.get("name"),
                a.get("owner"),
                a.get("base_model"),
                a.get("version"),
                a.get("rank"),
                status,
            )
        )
    stdout().print(rows)


@adapters_app.command("get")
def adapters_get(
    ctx: typer.Context, adapter_id: Annotated[str, typer.Argument(metavar="ID", help="Adapter ID.")]
) -> None:
    """Show one adapter and every version of it."""
    emit(ctx, admin_client(ctx).get(_path(adapter_id)), _print_adapter)


def _print_adapter(adapter: JSON) -> None:
    console = stdout()
    console.print(
        record(
            "Adapter",
            [
                ("id", adapter.get("id")),
                ("name", adapter.get("name")),
                ("model", adapter.get("model")),
                ("owner", adapter.get("owner")),
                ("base_model", adapter.get("base_model")),
                ("status", adapter.get("status")),
                ("pinned", "yes" if adapter.get("pinned") else "no"),
                ("version", adapter.get("version")),
                ("rank", adapter.get("rank")),
                ("targets", _targets(adapter)),
                ("sha256", adapter.get("sha256")),
                ("size", _size(adapter.get("size_bytes"))),
                ("created", fmt_time(adapter.get("created_at"))),
                ("updated", fmt_time(adapter.get("updated_at"))),
                ("deleted", fmt_time(adapter.get("deleted_at"))),
            ],
            pad_edge=False,
        )
    )
    versions: list[JSON] = adapter.get("versions") or []
    if versions:
        rows = table("VERSION", "RANK", "TARGETS", "SHA256", "SIZE", "CREATED", min_width=8)
        for v in versions:
            rows.add_row(
                *cells(
                    v.get("version"),
                    v.get("rank"),
                    _targets(v),
                    _sha(v.get("sha256")),
                    _size(v.get("size_bytes")),
                    fmt_time(v.get("created_at")),
                )
            )
        console.print(rows)


# --- pin, unpin, delete --------------------------------------------------------------------------------


@adapters_app.command("pin")
def adapters_pin(
    ctx: typer.Context, adapter_id: Annotated[str, typer.Argument(metavar="ID", help="Adapter ID.")]
) -> None:
    """Keep the adapter's newest version in a device slot on every replica (applied within seconds)."""
    adapter = admin_client(ctx).patch(_path(adapter_id), {"pinned": True})
    emit(
        ctx,
        adapter,
        lambda a: stdout().print(
            f"Pinned adapter {a.get('name')!r} ({a.get('id')}): version {a.get('version')} stays in a device "
            "slot on every replica of its engine, applied within seconds.",
            markup=False,
        ),
    )


@adapters_app.command("unpin")
def adapters_unpin(
    ctx: typer.Context, adapter_id: Annotated[str, typer.Argument(metavar="ID", help="Adapter ID.")]
) -> None:
    """Let the adapter's device slot be reused again when other adapters need one."""
    adapter = admin_client(ctx).patch(_path(adapter_id), {"pinned": False})
    emit(
        ctx,
        adapter,
        lambda a: stdout().print(
            f"Unpinned adapter {a.get('name')!r} ({a.get('id')}): its device slot may be reused "
            "when other adapters need one.",
            markup=False,
        ),
    )


@adapters_app.command("delete")
def adapters_delete(
    ctx: typer.Context,
    adapter_id: Annotated[str, typer.Argument(metavar="ID", help="Adapter ID.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Delete an adapter: unservable at once (404 to new requests; running ones finish), its slots freed.

    Its versions stay in the registry for the usage history; the name can be uploaded again, as a new one.
    """
    confirmed_delete(
        ctx,
        _path(adapter_id),
        yes=yes,
        already_gone=lambda adapter: adapter.get("status") == "deleted",
        question=lambda adapter: (
            f"Delete adapter {adapter.get('name')!r} ({adapter_id}) of {adapter.get('owner')}? "
            "It stops being servable at once (requests already running finish); "
            "its versions and usage history are kept."
        ),
        cancelled=f"cancelled: adapter {adapter_id} is unchanged",
        print_already=_print_already_deleted,
        print_done=_print_deleted,
    )


def _print_deleted(adapter: JSON) -> None:
    stdout().print(
        f"Deleted adapter {adapter.get('name')!r} ({adapter.get('id')}): no longer servable. "
        "Its versions and usage history are kept.",
        markup=False,
    )


def _print_already_deleted(adapter: JSON) -> None:
    stdout().print(
        f"Adapter {adapter.get('name')!r} ({adapter.get('id')}) is already deleted; nothing to do.",
        markup=False,
    )


# --- formatting ------------------------------------------------------------------------------------------


def _path(adapter_id: str) -> str:
    return f"/admin/adapters/{segment(adapter_id)}"


def _targets(data: JSON) -> str:
    targets = data.get("target_modules")
    return ", ".join(str(t) for t in targets) if isinstance(targets, list) else "-"


def _sha(value: object) -> object:
    return f"{value[:_SHA_PREFIX]}…" if isinstance(value, str) and len(value) > _SHA_PREFIX else value


def _size(value: object) -> str:
    """Bytes in binary units: `512 B`, `30.0 MiB`."""
    if not isinstance(value, int):
        return "-"
    if value < 1024:
        return f"{value} B"
    size, units = value / 1024, ["KiB", "MiB", "GiB", "TiB"]
    while size >= 1024 and len(units) > 1:
        size, units = size / 1024, units[1:]
    return f"{size:.1f} {units[0]}"
