"""Process checks for tests that stop process trees: alive or not, and gone within a bound."""

import os
import signal
import time
from pathlib import Path


def running(pid: int) -> bool:
    """Whether the process lives (a zombie no one has reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still running after `seconds` (killed then, so no test leaves them behind)."""
    deadline = time.monotonic() + seconds
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in pids if running(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return alive
