"""Pieces of the load test (bench/load_test.py) that stand in for production incidents, and the processes
it owns: a private redis-server behind a TCP proxy that can be cut, database outages (SQLite and
PostgreSQL), a Stripe stub that can be told to fail and then healed, and process-tree cleanup.

Everything here runs in ordinary OS threads: the load generator's gevent hub owns the main thread, and
these must never block it.
Run: python -m bench.load_test ... (this module has no entry point of its own).
"""

import contextlib
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import psutil

from bench.stripe_stub import StripeStub


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_for_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f}s") from None
            time.sleep(0.1)


# --- processes -----------------------------------------------------------------------------------------


def spawn(command: list[str], *, env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen[bytes]:
    """A child in a session of its own, so it and everything it starts can be stopped together."""
    out: IO[bytes] = log.open("ab")
    try:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    finally:
        out.close()  # the child holds its own copy of the descriptor


def stop_tree(process: subprocess.Popen[bytes] | None, *, grace_s: float = 30.0) -> None:
    """SIGTERM the process, its session and every descendant (Ray workers re-parent nothing, but some
    outlive their parent for a moment), then SIGKILL whatever is left. Only our own processes: the tree
    is collected from our child's pid before any signal is sent."""
    if process is None:
        return
    tree = [process.pid, *_descendants(process.pid)]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGTERM)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    _, alive = psutil.wait_procs([p for p in map(_proc, tree) if p is not None], timeout=5)
    for leftover in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            leftover.kill()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


def _descendants(pid: int) -> list[int]:
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _proc(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


# --- Redis ---------------------------------------------------------------------------------------------


class RedisServer:
    """A redis-server of our own on a free port (the machine's Redis on 6379 is never touched)."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (needed for --backend redis)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.process = spawn(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)],
            env=dict(os.environ), log=self.workdir / "redis.log", cwd=self.workdir,
        )  # fmt: skip
        wait_for_port(self.port, timeout=20)

    def stop(self) -> None:
        stop_tree(self.process, grace_s=10)
        self.process = None


class TcpProxy:
    """Forwards 127.0.0.1:<port> to a target port. `cut()` drops every connection and answers new ones by
    hanging up at once (a crashed or unreachable server, quickly); `restore()` forwards again. The server
    behind keeps its state, as a network partition would."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._down = False
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="redis-proxy", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def cut(self) -> None:
        with self._lock:
            self._down = True
            doomed, self._open = self._open, set()
        for sock in doomed:
            _close(sock)

    def restore(self) -> None:
        with self._lock:
            self._down = False

    def close(self) -> None:
        self._closed = True
        self.cut()
        _close(self._listener)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                down = self._down
            if down:
                _close(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=2)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.discard(source)
                self._open.discard(sink)
            _close(source)
            _close(sink)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


# --- databases -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def sqlite_outage(path: Path) -> Iterator[None]:
    """Nobody else may write while this is held (the platform runs SQLite in WAL mode: reads go on)."""
    lock = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
    try:
        lock.execute("BEGIN EXCLUSIVE")
        yield
        lock.execute("COMMIT")
    finally:
        lock.close()


@contextlib.contextmanager
def postgres_outage(admin_url: str, database: str) -> Iterator[None]:
    """The database refuses connections and every open one is terminated, as after a crash or failover;
    connections are allowed again afterwards."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(admin_url, autocommit=True, connect_timeout=10) as admin:
        name = sql.Identifier(database)
        admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(name))
        try:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()",
                (database,),
            )
            yield
        finally:
            admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(name))


# --- Stripe --------------------------------------------------------------------------------------------


class HealableStripeStub(StripeStub):
    """The test suite's Stripe stub, plus `heal()`: faults not yet served are dropped (Stripe is back)."""

    def heal(self) -> int:
        with self._lock:
            left = len(self._faults)
            self._faults.clear()
        return left

    def failures_served(self) -> int:
        return sum(1 for _, _, status in list(self.requests) if status >= 500 or status in (-1, 429))
