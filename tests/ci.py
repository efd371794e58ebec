"""Whether this run is CI, and what a missing prerequisite means there: a failure, never a skip.

CI systems set CI to "true", "1", "yes" or similar; any value that is not empty or plainly false counts.
"""

import os
from typing import NoReturn

import pytest

_FALSE = {"", "0", "false", "no", "off"}


def is_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in _FALSE


def missing(reason: str) -> NoReturn:
    """Fail under CI (a green CI must have run this), skip elsewhere."""
    if is_ci():
        pytest.fail(f"{reason} (mandatory under CI)")
    pytest.skip(f"{reason} (set CI=true to make this a failure)")
