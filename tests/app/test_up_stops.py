"""`loraplex up` stops `serve run` and everything under it on SIGTERM, however it was started: also as a
script's background job (`loraplex up &`), where the shell starts it with SIGINT ignored and the child
used to inherit that, ignoring the SIGINT `up` forwards (it ran on until killed by hand).

`serve run` is stood in for by a Python program that behaves as it does on SIGINT (KeyboardInterrupt:
stop the processes it started, exit 0) and starts one process of its own in its group, as `serve run`
starts its local Ray cluster; tests/e2e/test_readme_run.py stops the real one the same way."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.processes import gone_within, running

ROOT = Path(__file__).resolve().parents[2]
SERVE = """
import subprocess, sys, time
from pathlib import Path
cluster = subprocess.Popen(["sleep", "300"])
Path(sys.argv[1]).write_text(f"{__import__('os').getpid()} {cluster.pid}")
try:
    while True:
        time.sleep(0.1)
except KeyboardInterrupt:
    cluster.terminate()
    cluster.wait()
"""
STUCK = SERVE.replace(
    "import subprocess", "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)\nimport subprocess"
)
UP = """
import os, sys
from app.cli.run import _serve_until_stopped
serve = [sys.executable, "-c", sys.argv[1], sys.argv[2]]
sys.exit(_serve_until_stopped(serve, dict(os.environ), float(sys.argv[3])))
"""


def ignore_sigint() -> None:
    """What a non-interactive shell does to a background job (`up &`), in its own session here."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture
def start_up(tmp_path: Path) -> Iterator[object]:
    started: list[subprocess.Popen[str]] = []

    def start(serve: str, grace_s: float = 60.0) -> tuple[subprocess.Popen[str], list[int]]:
        pids = tmp_path / f"pids-{len(started)}"
        up = subprocess.Popen(
            [sys.executable, "-c", UP, serve, str(pids), str(grace_s)],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=ignore_sigint, text=True,
        )  # fmt: skip
        started.append(up)
        deadline = time.monotonic() + 60
        while not (pids.exists() and len(pids.read_text().split()) == 2):
            assert up.poll() is None and time.monotonic() < deadline, "the stand-in did not start"
            time.sleep(0.05)
        return up, [up.pid, *map(int, pids.read_text().split())]

    yield start
    for up in started:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


def test_sigterm_stops_serve_run_and_its_cluster_when_up_ran_with_sigint_ignored(start_up) -> None:
    up, tree = start_up(SERVE)
    up.send_signal(signal.SIGTERM)
    try:
        assert up.wait(timeout=30) == 0
    except subprocess.TimeoutExpired:
        pytest.fail("`up` did not stop on SIGTERM: `serve run` ignored the SIGINT it was sent")
    assert gone_within(tree, 10) == []


def test_a_serve_run_that_does_not_stop_is_killed_with_its_cluster(start_up) -> None:
    up, tree = start_up(STUCK, grace_s=2)
    up.send_signal(signal.SIGTERM)
    assert up.wait(timeout=30) == 0
    assert gone_within(tree, 10) == []


def test_a_second_sigterm_kills_at_once(start_up) -> None:
    up, tree = start_up(STUCK, grace_s=600)
    up.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    up.send_signal(signal.SIGTERM)
    assert up.wait(timeout=30) == 0
    assert gone_within(tree, 10) == []


def test_a_sigint_that_up_was_started_ignoring_stays_ignored(start_up) -> None:
    """A background job's SIGINT is ignored so that Ctrl-C in its terminal leaves it running."""
    up, tree = start_up(SERVE)
    up.send_signal(signal.SIGINT)
    time.sleep(1.0)
    assert all(map(running, tree)), "`up` passed on a SIGINT its starter had told it to ignore"
    up.send_signal(signal.SIGTERM)
    assert up.wait(timeout=30) == 0
    assert gone_within(tree, 10) == []
