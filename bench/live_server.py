"""LiveServer: an ASGI app under uvicorn in a thread, on a port bound before it starts; stopped cleanly.
The app tests (tests/app/conftest.py) and the benches that serve the HTTP app without Ray share it."""

import socket
import threading
import time

import uvicorn
from starlette.types import ASGIApp


class LiveServer:
    """uvicorn in a thread; stopped cleanly."""

    def __init__(self, app: ASGIApp) -> None:
        # Bound here and handed to uvicorn: no window in which another process could take the port.
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = int(self.socket.getsockname()[1])
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()
