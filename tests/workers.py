"""How the suite splits across pytest-xdist's two workers (`-n 2 --dist loadgroup`, pyproject's addopts).

The serial group runs first and alone on one worker: the e2e modules (a shared Serve app, `serve run`,
`loraplex up`, clusters whose faults are timed against streams), the external load clients, and every test
that starts Ray in its own process (the limiter's and budgets' `ray` backend). Those were written for one
Ray cluster at a time in the test's process. Every other test runs with the rest of its module on the other
worker, so a module's fixtures are built once. Most of a serial test's time is waiting (process starts,
streams, timeouts), which is what the other worker fills. The benches' tiny modes run there too, also the
ones that deploy a Serve app in a child process of their own: each is its own cluster on free ports, and a
tiny mode asserts no timing.

The group is read from the node id alone, because xdist's scheduler sees only ids (and pytest 9 ignores
the id suffix that xdist's own `xdist_group` mark relies on). tests/conftest.py fails a test outside the
group that leaves Ray initialized in its worker, so a new in-process Ray test cannot silently run beside
the cluster tests.
"""

import os
import sys

import pytest
from xdist.scheduler import LoadScopeScheduling

SERIAL = "ray"
# Whole files or folders in the serial group.
SERIAL_PATHS = (
    "tests/e2e/",
    "tests/test_external_clients.py",
)
# The limiter's and budgets' backend parameter that starts a module's Ray cluster (tests/limits).
RAY_PARAM = "ray"


def group_of(nodeid: str) -> str:
    path, _, name = nodeid.partition("::")
    if path.startswith(SERIAL_PATHS):
        return SERIAL
    params = name[name.index("[") + 1 : -1].split("-") if name.endswith("]") and "[" in name else []
    return SERIAL if RAY_PARAM in params else path


class SerialGroupScheduling(LoadScopeScheduling):  # type: ignore[misc]  # xdist ships no types
    """xdist's module-at-a-time scheduling, with every serial test in one unit. A unit is handed out
    whole, in collection order, so the serial group (first on every worker, `serial_first`) goes to one
    worker at the start and the other takes module after module beside it."""

    def _split_scope(self, nodeid: str) -> str:
        return group_of(nodeid)


def serial_first(items: list[pytest.Item]) -> None:
    """On a worker, the serial group first (every worker sorts alike, as xdist requires); the collection
    order otherwise, so e2e modules keep theirs."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: group_of(item.nodeid) != SERIAL)


def ray_left_running() -> bool:
    ray = sys.modules.get("ray")
    # A thread of the app (app/dependency_noise.py) may be importing ray right now: a module half made
    # has no is_initialized yet, and nothing of it can be running.
    is_initialized = getattr(ray, "is_initialized", None)
    return is_initialized is not None and bool(is_initialized())
