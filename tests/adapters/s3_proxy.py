"""A recording HTTP proxy in front of moto's real S3 server: it lists the requests a store makes, and can
drop `If-None-Match`, as S3-compatible services that ignore conditional creates do (a second create of
one object then overwrites it)."""

import http.client
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect"}


@dataclass
class S3Proxy:
    url: str
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path with query)


@contextmanager
def s3_proxy(endpoint: str, *, conditional_creates: bool = True) -> Iterator[S3Proxy]:
    """A URL forwarding every request to the S3 `endpoint`; without `conditional_creates`, minus its
    If-None-Match header."""
    target = urlsplit(endpoint)
    dropped = _HOP_BY_HOP if conditional_creates else _HOP_BY_HOP | {"if-none-match"}
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    proxy = S3Proxy(f"http://127.0.0.1:{server.server_address[1]}")

    class Forward(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def forward(self) -> None:
            proxy.requests.append((self.command, self.path))
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else None
            headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
            upstream = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=30)
            try:
                upstream.request(self.command, self.path, body=body, headers=headers)
                reply = upstream.getresponse()
                data = reply.read()
            finally:
                upstream.close()
            self.send_response(reply.status)
            for name, value in reply.getheaders():
                if name.lower() not in (*_HOP_BY_HOP, "content-length"):
                    self.send_header(name, value)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward  # noqa: N815 (http.server names them)

        def log_message(self, *args: object) -> None:
            pass

    server.RequestHandlerClass = Forward
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        server.shutdown()
        server.server_close()
