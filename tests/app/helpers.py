"""Small helpers the app tests share."""

import json
import uuid
from typing import Any

from typer.testing import Result


def unique(prefix: str) -> str:
    """A name no other test took: `prefix` and a random suffix (the served database outlives one test)."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def as_json(result: Result, code: int = 0) -> Any:
    """What a CLI run printed, as JSON, once it exited with `code`."""
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)
