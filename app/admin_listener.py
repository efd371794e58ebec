"""AdminListener: the admin API on a listener of its own (Settings.admin_listen), beside the tenant port.

uvicorn in a thread of the ingress process. The socket is opened with SO_REUSEPORT, so the ingress
replicas of one node all listen on the same address and the kernel spreads connections among them.
"""

import socket
import threading
import time

import uvicorn
from fastapi import FastAPI


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"admin_listen must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


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
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, name="admin-listener", daemon=True
        )

    def start(self, timeout_s: float = 20.0) -> "AdminListener":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the admin listener did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()
