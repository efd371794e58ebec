"""Small helpers the app tests share."""

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from typer.testing import Result


def unique(prefix: str) -> str:
    """A name no other test took: `prefix` and a random suffix (the served database outlives one test)."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def as_json(result: Result, code: int = 0) -> Any:
    """What a CLI run printed, as JSON, once it exited with `code`."""
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


def wait_for(condition: Callable[[], bool], timeout: float = 15.0) -> None:
    """Poll `condition` until it holds; fail after `timeout` seconds (reached only when a test fails)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.02)
