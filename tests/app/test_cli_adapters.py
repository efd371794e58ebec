"""`loraplex adapters` against the live app; the streamed upload against a small local sink server."""

import json
import shutil
import tarfile
import threading
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner, Result

from app.cli import build_app
from app.cli.adapters import FilePart, MultipartBody
from tests.app.conftest import MODEL, Served, free_port
from tests.app.helpers import as_json

WEIGHTS = "adapter_model.safetensors"


def chat_status(served: Served, key: str, model: str) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{served.url}/v1/chat/completions", json=body, headers=headers, timeout=30).status_code


def owner(served: Served) -> tuple[str, str]:
    return served.new_tenant(f"cli-ad-{uuid.uuid4().hex[:8]}")


class Sink:
    """A tiny HTTP server that reads POST bodies in small pieces, keeps only their edges, answers 201."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                left = int(self.headers.get("content-length", "0"))
                head, tail, received = b"", b"", 0
                while left:
                    chunk = self.rfile.read(min(left, 65536))
                    if not chunk:
                        break
                    head = head or chunk[:512]
                    tail = (tail + chunk)[-64:]
                    received += len(chunk)
                    left -= len(chunk)
                sink.requests.append({"headers": dict(self.headers), "received": received, "head": head,
                                      "tail": tail})  # fmt: skip
                payload = json.dumps({"id": "ad_sink", "object": "adapter"}).encode()
                self.send_response(201)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def run(self, *args: str) -> Result:
        return CliRunner().invoke(build_app(), ["--url", self.url, "--admin-key", "k", *args])


@pytest.fixture
def sink() -> Iterator[Sink]:
    server = Sink()
    thread = threading.Thread(target=server.server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.server.shutdown()
    thread.join(5)


def test_upload_a_directory_then_a_new_version(cli: Callable[..., Result], served: Served) -> None:
    tenant_id, key = owner(served)
    source = served.setup.adapter_dirs["demo-sql"]
    uploaded = cli("adapters", "upload", str(source), "--name", "sql", "--owner", tenant_id)
    assert uploaded.exit_code == 0, uploaded.output
    for shown in ("Uploaded adapter", tenant_id, "sql", MODEL, "k_proj, o_proj, q_proj, v_proj", "KiB"):
        assert shown in uploaded.stdout
    assert "model='sql'" in uploaded.stdout
    assert "uploaded demo-sql" in uploaded.stderr  # the progress bar's last state
    assert chat_status(served, key, "sql") == 200

    again = as_json(cli("--json", "adapters", "upload", str(source), "--name", "sql", "--owner", tenant_id))
    assert again["version"] == 2 and [v["version"] for v in again["versions"]] == [1, 2]
    assert again["sha256"] in json.dumps(again["versions"])
    assert again["sha256"][:12] in uploaded.stdout  # the table shows a prefix of the same weights

    human = cli("adapters", "get", again["id"])
    assert human.exit_code == 0, human.output
    assert again["sha256"] in human.stdout and "VERSION" in human.stdout


def test_upload_an_archive(cli: Callable[..., Result], served: Served, tmp_path: Path) -> None:
    tenant_id, key = owner(served)
    archive = tmp_path / "my-adapter.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for file in ("adapter_config.json", WEIGHTS):
            tar.add(served.setup.adapter_dirs["demo-poet"] / file, arcname=f"my-adapter/{file}")
    args = ("upload", str(archive), "--name", "poet", "--owner", tenant_id, "--base-model", MODEL)
    adapter = as_json(cli("--json", "adapters", *args))
    assert (adapter["name"], adapter["version"], adapter["base_model"]) == ("poet", 1, MODEL)
    assert chat_status(served, key, "poet") == 200


def test_list_get_pin_unpin_delete(cli: Callable[..., Result], served: Served) -> None:
    tenant_id, key = owner(served)
    source = str(served.setup.adapter_dirs["demo-chef"])
    adapter = as_json(cli("--json", "adapters", "upload", source, "--name", "chef", "--owner", tenant_id))
    adapter_id = adapter["id"]

    listed = as_json(cli("--json", "adapters", "list", "--owner", tenant_id))
    assert [a["id"] for a in listed["data"]] == [adapter_id]
    human = cli("adapters", "list", "--owner", tenant_id, "--base-model", MODEL)
    assert human.exit_code == 0 and adapter_id in human.stdout and "chef" in human.stdout
    assert "No adapters match" in cli("adapters", "list", "--base-model", "no-such-base").stdout

    got = as_json(cli("--json", "adapters", "get", adapter_id))
    assert got["status"] == "ready" and len(got["versions"]) == 1

    assert as_json(cli("--json", "adapters", "pin", adapter_id))["pinned"] is True
    assert "Unpinned" in cli("adapters", "unpin", adapter_id).stdout
    assert as_json(cli("--json", "adapters", "get", adapter_id))["pinned"] is False

    declined = cli("adapters", "delete", adapter_id, input="n\n")
    assert declined.exit_code == 1
    assert "history are kept" in declined.stderr and "cancelled" in declined.stderr
    assert chat_status(served, key, "chef") == 200

    deleted = cli("adapters", "delete", adapter_id, input="y\n")
    assert deleted.exit_code == 0, deleted.output
    assert "no longer servable" in deleted.stdout
    deadline = time.monotonic() + 3
    while chat_status(served, key, "chef") != 404:
        assert time.monotonic() < deadline, "deleted adapter still served after 3 s"
        time.sleep(0.05)

    assert as_json(cli("--json", "adapters", "list", "--owner", tenant_id))["data"] == []
    every = as_json(cli("--json", "adapters", "list", "--owner", tenant_id, "--all"))["data"]
    assert [(a["id"], a["status"]) for a in every] == [(adapter_id, "deleted")]
    assert "already deleted" in cli("adapters", "delete", adapter_id).stdout
    assert cli("adapters", "delete", adapter_id, "--yes").exit_code == 0  # idempotent on the server too
    pin = cli("adapters", "pin", adapter_id)
    assert pin.exit_code == 1 and "404" in pin.stderr


def test_platform_refusal_exits_1_with_its_message(cli: Callable[..., Result], served: Served) -> None:
    tenant_id, _ = owner(served)
    source = str(served.setup.adapter_dirs["demo-sql"])
    refused = cli("adapters", "upload", source, "--name", "x", "--owner", tenant_id, "--base-model", "nope")
    assert refused.exit_code == 1
    assert "base_model 'nope' is not served here" in refused.stderr and "HTTP 400" in refused.stderr
    assert refused.stdout == "" and "Traceback" not in refused.output
    missing = cli("adapters", "get", "ad_nosuchadapter")
    assert missing.exit_code == 1 and "404" in missing.stderr


def test_bad_sources_exit_2_before_any_request(sink: Sink, served: Served, tmp_path: Path) -> None:
    pickled = tmp_path / "pickled"
    shutil.copytree(served.setup.adapter_dirs["demo-sql"], pickled)
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04")
    result = sink.run("adapters", "upload", str(pickled), "--name", "x", "--owner", "public")
    assert result.exit_code == 2
    assert "adapter_model.bin" in result.stderr and "refuses them too" in result.stderr

    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "adapter_config.json").write_text("{}")
    result = sink.run("adapters", "upload", str(incomplete), "--name", "x", "--owner", "public")
    assert result.exit_code == 2 and f"{WEIGHTS} missing" in result.stderr

    (tmp_path / "notes.txt").write_text("")
    for path in (tmp_path / "nothing-here", tmp_path / "notes.txt"):
        result = sink.run("adapters", "upload", str(path), "--name", "x", "--owner", "public")
        assert result.exit_code == 2, result.output
    assert sink.requests == []


def test_unreachable_platform_exits_2(served: Served) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    source = str(served.setup.adapter_dirs["demo-sql"])
    args = [
        "--url",
        url,
        "--admin-key",
        "k",
        "adapters",
        "upload",
        source,
        "--name",
        "x",
        "--owner",
        "public",
    ]
    result = CliRunner().invoke(build_app(), args)
    assert result.exit_code == 2
    assert f"cannot reach {url}" in result.stderr and "Traceback" not in result.output


def test_the_upload_streams_and_never_holds_the_weights(sink: Sink, tmp_path: Path) -> None:
    size = 30 * 2**20
    (tmp_path / "adapter_config.json").write_text('{"r": 8}')
    with (tmp_path / WEIGHTS).open("wb") as weights:
        weights.truncate(size)
    body = MultipartBody({"name": "big"}, [FilePart("adapter_model", tmp_path / WEIGHTS, WEIGHTS)])
    assert not isinstance(body.chunks(), bytes | bytearray | list)  # a generator, consumed once

    tracemalloc.start()
    try:
        result = sink.run("--json", "adapters", "upload", str(tmp_path), "--name", "big", "--owner", "public")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert as_json(result)["id"] == "ad_sink"
    assert peak < 4 * 2**20, f"peak {peak / 2**20:.1f} MiB while sending a 30 MiB file"

    [request] = sink.requests
    headers = {k.lower(): v for k, v in request["headers"].items()}
    assert "transfer-encoding" not in headers  # the length is known up front
    assert request["received"] == int(headers["content-length"]) > size
    boundary = headers["content-type"].split("boundary=")[1]
    assert request["head"].startswith(f'--{boundary}\r\nContent-Disposition: form-data; name="name"'.encode())
    assert request["tail"].endswith(f"--{boundary}--\r\n".encode())
