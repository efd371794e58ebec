"""receive_upload: streaming multipart uploads with the size limit enforced while receiving.

A tiny app mounts it; tests drive it in-process (httpx.ASGITransport, where we can see exactly how much
of the body was pulled) and through real uvicorn (where limits and disconnects meet real sockets).
"""

import hashlib
import json
import os
import socket
import time
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from app.errors import install_error_handlers
from app.upload import MAX_FIELD_BYTES, receive_upload
from bench.live_server import LiveServer

BOUNDARY = "loraplex-test-boundary"
MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"
FILE_FIELDS = {"file", "config"}
CHUNK = 64 * 1024
MIB = 1024 * 1024
LIVE_LIMIT = 3 * MIB  # max_bytes of the uvicorn-served app


def make_app(tmp_root: Path, max_bytes: int = 50_000_000) -> tuple[FastAPI, list[str]]:
    """The upload route and a list that records client disconnects seen by it."""
    app = FastAPI()
    install_error_handlers(app)
    disconnects: list[str] = []

    @app.post("/upload")
    async def upload(request: Request) -> Any:
        try:
            received = await receive_upload(
                request, tmp_root=tmp_root, max_bytes=max_bytes, allowed_file_fields=FILE_FIELDS
            )
        except ClientDisconnect:
            disconnects.append("disconnect")
            return JSONResponse({}, status_code=499)  # nobody is listening any more
        try:
            files = {}
            for name, f in received.files.items():
                digest = hashlib.sha256()
                with f.path.open("rb") as fh:
                    while block := fh.read(1 << 20):
                        digest.update(block)
                files[name] = {
                    "filename": f.filename,
                    "size": f.size,
                    "sha256": digest.hexdigest(),
                    "content_type": f.content_type,
                    "stored_as": f.path.name,
                    "in_directory": f.path.parent == received.directory,
                }
            return {"fields": received.fields, "files": files}
        finally:
            received.cleanup()

    return app, disconnects


def part(name: str, data: bytes, filename: str | None = None, content_type: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + ("" if filename is None else f'; filename="{filename}"')
    head = f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n"
    if content_type:
        head += f"Content-Type: {content_type}\r\n"
    return (head + "\r\n").encode() + data + b"\r\n"


def multipart(*parts: bytes) -> bytes:
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


def leftovers(tmp_root: Path) -> list[Path]:
    return list(tmp_root.iterdir()) if tmp_root.exists() else []


def request_head(*headers: str) -> str:
    lines = ["POST /upload HTTP/1.1", "Host: t", f"Content-Type: {MULTIPART}", *headers]
    return "\r\n".join(lines) + "\r\n\r\n"


def read_until_closed(sock: socket.socket) -> bytes:
    """All the server sends until it closes the connection (a timeout fails the test)."""
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # closed with our unread bytes still in its buffer: data came first
            return received
        if not chunk:
            return received
        received += chunk


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def tmp_root(tmp_path: Path) -> Path:
    return tmp_path / "uploads"


@pytest.fixture
async def asgi(tmp_root: Path) -> AsyncIterator[httpx.AsyncClient]:
    app, _ = make_app(tmp_root)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        yield c


@pytest.fixture
def live(tmp_root: Path) -> Iterator[tuple[str, list[str]]]:
    app, disconnects = make_app(tmp_root, max_bytes=LIVE_LIMIT)
    with LiveServer(app) as server:
        yield server.url, disconnects


@pytest.fixture(params=["asgi", "uvicorn"])
async def client(request: pytest.FixtureRequest, tmp_root: Path) -> AsyncIterator[httpx.AsyncClient]:
    app, _ = make_app(tmp_root)
    if request.param == "asgi":
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            yield c
    else:
        with LiveServer(app) as server:
            async with httpx.AsyncClient(base_url=server.url) as c:
                yield c


def assert_error(response: httpx.Response, status: int, code: str, *words: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"]
    return error


# --- round trips ---------------------------------------------------------------------------------------


async def test_fields_and_two_files_round_trip_byte_exact(client: httpx.AsyncClient, tmp_root: Path) -> None:
    # Bytes that look like the start of a delimiter, split across httpx's 64 KiB chunks, must survive.
    weights = os.urandom(200_000) + f"\r\n--{BOUNDARY}".encode() + b"\r\n--" + os.urandom(100_001)
    config = json.dumps({"r": 8, "lora_alpha": 16}).encode()
    response = await client.post(
        "/upload",
        data={"name": "my-adapter", "note": "héllo wörld"},
        files={
            "file": ("../../etc/passwd", weights, "application/octet-stream"),
            "config": ("adapter_config.json", config, "application/json"),
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["fields"] == {"name": "my-adapter", "note": "héllo wörld"}
    assert body["files"] == {
        "file": {
            "filename": "passwd",
            "size": len(weights),
            "sha256": sha256(weights),
            "content_type": "application/octet-stream",
            "stored_as": "part-file",
            "in_directory": True,
        },
        "config": {
            "filename": "adapter_config.json",
            "size": len(config),
            "sha256": sha256(config),
            "content_type": "application/json",
            "stored_as": "part-config",
            "in_directory": True,
        },
    }
    assert leftovers(tmp_root) == []  # cleanup() removed the directory


@pytest.mark.parametrize(
    ("sent", "kept"),
    [("..\\..\\evil.bin", "evil.bin"), ("/tmp/ünï.bin", "ünï.bin"), ("..", ""), ("a\x01b", "ab"), ("", "")],
)
async def test_file_names_are_reduced_to_basenames(asgi: httpx.AsyncClient, sent: str, kept: str) -> None:
    body = multipart(part("file", b"x", filename=sent.replace("\\", "\\\\")))
    response = await asgi.post("/upload", content=body, headers={"content-type": MULTIPART})
    assert response.status_code == 200, response.text
    assert response.json()["files"]["file"]["filename"] == kept
    assert response.json()["files"]["file"]["stored_as"] == "part-file"


async def test_empty_file_and_empty_form(asgi: httpx.AsyncClient) -> None:
    response = await asgi.post(
        "/upload", content=multipart(part("file", b"", filename="e")), headers={"content-type": MULTIPART}
    )
    assert response.json()["files"]["file"]["size"] == 0
    response = await asgi.post("/upload", content=multipart(), headers={"content-type": MULTIPART})
    assert response.json() == {"fields": {}, "files": {}}


async def test_large_file_streams_with_bounded_memory(tmp_path: Path, tmp_root: Path) -> None:
    size = 20 * 1024 * 1024
    source = tmp_path / "big.bin"
    digest = hashlib.sha256()
    with source.open("wb") as fh:
        for _ in range(size // (1 << 20)):
            block = os.urandom(1 << 20)
            digest.update(block)
            fh.write(block)
    app, _ = make_app(tmp_root)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        tracemalloc.start()
        try:
            with source.open("rb") as fh:  # httpx reads it in 64 KiB chunks
                response = await c.post("/upload", files={"file": ("big.bin", fh)})
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert response.status_code == 200, response.text
    assert response.json()["files"]["file"]["sha256"] == digest.hexdigest()
    assert response.json()["files"]["file"]["size"] == size
    # Client and server together, in one process: a 1 MiB write buffer and a few chunks, never the file.
    assert peak < size / 5, f"peak {peak / 1e6:.1f} MB for a {size / 1e6:.0f} MB upload"


# --- size limit --------------------------------------------------------------------------------------


async def test_content_length_over_limit_is_refused_before_the_body_is_read(tmp_root: Path) -> None:
    app, _ = make_app(tmp_root, max_bytes=MIB)
    pulled: list[int] = []

    async def body() -> AsyncIterator[bytes]:
        pulled.append(1)
        yield b"x" * 1000

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        response = await c.post(
            "/upload", content=body(), headers={"content-type": MULTIPART, "content-length": str(5 * MIB)}
        )
    error = assert_error(response, 413, "upload_too_large", "5.00 MB", "1.00 MB")
    assert error["type"] == "invalid_request_error"
    assert pulled == []
    assert leftovers(tmp_root) == []


def test_content_length_over_limit_over_uvicorn_never_asks_for_the_body(
    live: tuple[str, list[str]], tmp_root: Path
) -> None:
    url, _ = live
    port = int(url.rsplit(":", 1)[1])
    # With `Expect: 100-continue` uvicorn only invites the body once the app reads it: the 413 must
    # come without that invitation, and without us sending a single body byte.
    head = request_head(f"Content-Length: {10 * 1024 * MIB}", "Expect: 100-continue")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head.encode())
        response = read_until_closed(sock)
    status, _, rest = response.partition(b"\r\n")
    assert status == b"HTTP/1.1 413 Request Entity Too Large"
    assert b"100 Continue" not in response
    assert b"connection: close" in rest.lower()
    error = json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "upload_too_large" and "10240.00 MB" in error["message"]
    assert leftovers(tmp_root) == []


async def test_chunked_upload_over_limit_stops_at_the_limit_and_leaves_nothing(tmp_root: Path) -> None:
    limit = MIB
    app, _ = make_app(tmp_root, max_bytes=limit)
    sent = 0
    saw_directory = False

    async def body() -> AsyncIterator[bytes]:  # no Content-Length: httpx sends it chunked
        nonlocal sent, saw_directory
        head = part("file", b"", filename="w.bin")[:-2]  # headers only; the data follows
        sent += len(head)
        yield head
        for _ in range(10 * limit // CHUNK):
            saw_directory = saw_directory or bool(leftovers(tmp_root))
            sent += CHUNK
            yield os.urandom(CHUNK)

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        response = await c.post("/upload", content=body(), headers={"content-type": MULTIPART})
    assert_error(response, 413, "upload_too_large", "1.00 MB")
    assert saw_directory
    assert sent <= limit + CHUNK  # not one chunk more was pulled than the one that crossed the limit
    assert leftovers(tmp_root) == []


def test_chunked_upload_over_limit_over_uvicorn(live: tuple[str, list[str]], tmp_root: Path) -> None:
    url, _ = live
    port = int(url.rsplit(":", 1)[1])
    head = request_head("Transfer-Encoding: chunked")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head.encode())
        sent = 0
        file_data = [os.urandom(CHUNK)] * (LIVE_LIMIT // CHUNK + 1)
        for data in [part("file", b"", filename="w.bin")[:-2], *file_data]:
            sock.sendall(b"%x\r\n%b\r\n" % (len(data), data))
            sent += len(data)
        assert sent > LIVE_LIMIT
        # The body is not finished, yet the 413 comes, and then the server closes: it will not read the rest.
        response = read_until_closed(sock)
    status, _, rest = response.partition(b"\r\n")
    assert status == b"HTTP/1.1 413 Request Entity Too Large"
    assert b"connection: close" in rest.lower()
    assert json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "upload_too_large"
    assert leftovers(tmp_root) == []


async def test_at_the_limit_is_accepted(tmp_root: Path) -> None:
    body = multipart(part("file", b"z" * 5000, filename="a"))
    app, _ = make_app(tmp_root, max_bytes=len(body))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        ok = await c.post("/upload", content=body, headers={"content-type": MULTIPART})
        assert ok.status_code == 200, ok.text
        over = await c.post("/upload", content=body + b"\r\n", headers={"content-type": MULTIPART})
        assert_error(over, 413, "upload_too_large")


# --- refused requests --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json",
        "application/x-www-form-urlencoded",
        f"multipart/mixed; boundary={BOUNDARY}",
        "multipart/form-data",  # no boundary
        "multipart/form-data; boundary=",
        "multipart/form-data; charset=utf-8",
        "multipart/form-data; boundary=" + "b" * 300,  # python-multipart refuses boundaries over 256
        None,
    ],
)
async def test_wrong_content_type_or_missing_boundary(
    asgi: httpx.AsyncClient, tmp_root: Path, content_type: str | None
) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    response = await asgi.post("/upload", content=multipart(part("a", b"1")), headers=headers)
    assert_error(response, 400, "invalid_content_type", "multipart/form-data")
    assert leftovers(tmp_root) == []


VALID = multipart(part("name", b"x"), part("file", b"y" * 1000, filename="f"))


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"this is not multipart at all", id="garbage"),
        pytest.param(VALID[: len(VALID) // 2], id="truncated-in-file-data"),
        pytest.param(VALID[:60], id="truncated-in-headers"),
        pytest.param(VALID[: -len(f"--{BOUNDARY}--\r\n")], id="no-closing-boundary"),
        pytest.param(b"", id="empty"),
        pytest.param(multipart(f"--{BOUNDARY}\r\nContent-Type: a/b\r\n\r\nx\r\n".encode()), id="no-name"),
        pytest.param(multipart(part("a", b"\xff\xfe")), id="field-not-utf8"),
        pytest.param(
            multipart(f"--{BOUNDARY}\r\nX-Big: {'h' * 5000}\r\n\r\nx\r\n".encode()), id="huge-part-header"
        ),
    ],
)
async def test_malformed_body(asgi: httpx.AsyncClient, tmp_root: Path, body: bytes) -> None:
    response = await asgi.post("/upload", content=body, headers={"content-type": MULTIPART})
    assert_error(response, 400, "malformed_multipart", "malformed multipart body")
    assert leftovers(tmp_root) == []


async def test_unknown_file_field(asgi: httpx.AsyncClient, tmp_root: Path) -> None:
    body = multipart(part("file", b"ok", filename="a"), part("weights", b"evil", filename="b"))
    response = await asgi.post("/upload", content=body, headers={"content-type": MULTIPART})
    error = assert_error(response, 400, "unexpected_file", "'weights'")
    assert error["param"] == "weights"
    assert leftovers(tmp_root) == []


async def test_file_field_sent_as_text(asgi: httpx.AsyncClient) -> None:
    body = multipart(part("file", b"x"))
    response = await asgi.post("/upload", content=body, headers={"content-type": MULTIPART})
    assert_error(response, 400, "expected_file", "'file'")


@pytest.mark.parametrize(
    "parts",
    [
        pytest.param([part("file", b"1", filename="a"), part("file", b"2", filename="b")], id="file"),
        pytest.param([part("name", b"1"), part("name", b"2")], id="text"),
        pytest.param([part("name", b"1"), part("name", b"2", filename="b")], id="text-then-file"),
    ],
)
async def test_repeated_field(asgi: httpx.AsyncClient, tmp_root: Path, parts: list[bytes]) -> None:
    response = await asgi.post("/upload", content=multipart(*parts), headers={"content-type": MULTIPART})
    error = assert_error(response, 400, "duplicate_field", "more than once")
    assert error["param"] in {"file", "name"}
    assert leftovers(tmp_root) == []


async def test_field_over_4_kib(asgi: httpx.AsyncClient) -> None:
    at_limit = multipart(part("note", b"n" * MAX_FIELD_BYTES))
    response = await asgi.post("/upload", content=at_limit, headers={"content-type": MULTIPART})
    assert response.json()["fields"]["note"] == "n" * MAX_FIELD_BYTES
    over = multipart(part("note", b"n" * (MAX_FIELD_BYTES + 1)))
    response = await asgi.post("/upload", content=over, headers={"content-type": MULTIPART})
    assert_error(response, 400, "field_too_large", "'note'")


async def test_too_many_fields(asgi: httpx.AsyncClient) -> None:
    sixteen = [part(f"f{i}", b"v") for i in range(16)]
    response = await asgi.post("/upload", content=multipart(*sixteen), headers={"content-type": MULTIPART})
    assert len(response.json()["fields"]) == 16
    seventeen = [*sixteen, part("file", b"v", filename="a")]  # files count too
    response = await asgi.post("/upload", content=multipart(*seventeen), headers={"content-type": MULTIPART})
    assert_error(response, 400, "too_many_fields", "16")


async def test_unsafe_allowed_field_name_is_a_programming_error(tmp_root: Path) -> None:
    app = FastAPI()

    @app.post("/upload")
    async def upload(request: Request) -> None:
        await receive_upload(request, tmp_root=tmp_root, max_bytes=10, allowed_file_fields={"../x"})

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        with pytest.raises(ValueError, match="safe file names"):
            await c.post("/upload", content=multipart(), headers={"content-type": MULTIPART})


# --- client disconnects ------------------------------------------------------------------------------


def test_client_disconnect_mid_upload_leaves_no_temp_dir(live: tuple[str, list[str]], tmp_root: Path) -> None:
    url, disconnects = live
    port = int(url.rsplit(":", 1)[1])
    head = part("file", b"", filename="w.bin")[:-2]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request_head(f"Content-Length: {LIVE_LIMIT - 1000}").encode())
        sock.sendall(head + os.urandom(LIVE_LIMIT // 2))  # half of the declared body
        deadline = time.monotonic() + 5
        while not list(tmp_root.glob("*/part-file")):  # a half-written file is on disk
            assert time.monotonic() < deadline, "the upload never started"
            time.sleep(0.01)
    deadline = time.monotonic() + 5
    while leftovers(tmp_root) or not disconnects:
        assert time.monotonic() < deadline, f"left behind: {leftovers(tmp_root)}, {disconnects}"
        time.sleep(0.01)
    assert disconnects == ["disconnect"]
