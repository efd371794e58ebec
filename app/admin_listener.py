"""AdminListener: the admin API on a listener of its own (Settings.admin_listen), beside the tenant port.

uvicorn on the event loop of the code that starts it: in an ingress replica that is the loop Serve runs the
tenant app on. The two apps share the replica's services, and several of those hold clients bound to the
loop that first used them (redis.asyncio connection pools, Serve handles' routers); a second loop in a
thread of its own would use them from two threads at once. Without a running loop (a script, a test) it
runs in a thread with its own loop.

The socket is opened with SO_REUSEPORT, so the ingress replicas of one node all listen on the same address
and the kernel spreads connections among them.
"""

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

log = logging.getLogger(__name__)


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"admin_listen must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the process's signals belong to whoever runs it (Ray's worker, `serve run`), not to us


class AdminListener:
    def __init__(self, app: FastAPI, address: str) -> None:
        host, port = parse_address(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self.socket.bind((host, port))
        self.port = int(self.socket.getsockname()[1])
        # log_config=None: uvicorn's own logging setup would close every handler the process has (Serve's
        # log files among them) through logging.config.dictConfig.
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off")
        self.server = _Server(config)
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 20.0) -> "AdminListener":
        """Serve on the running event loop if the caller has one (the listener is up once that loop runs
        again), else in a thread of its own (up when this returns)."""
        self.socket.listen(2048)  # connections queue from now on, before uvicorn's first accept
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return self._start_in_thread(timeout_s)
        self._task = loop.create_task(self.server.serve(sockets=[self.socket]), name="admin-listener")
        self._task.add_done_callback(_log_end)
        return self

    def _start_in_thread(self, timeout_s: float) -> "AdminListener":
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, name="admin-listener", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the admin listener did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop accepting and let requests in flight finish (uvicorn's shutdown, on the loop it runs on)."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            self.socket.close()


def _log_end(task: "asyncio.Task[None]") -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the admin listener stopped", exc_info=task.exception())
