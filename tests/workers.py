"""How the suite splits across pytest-xdist's two workers (`-n 2 --dist loadgroup`, pyproject's addopts).

A test that starts Ray, in this process (a fixture) or in a child (`serve run`, `loraplex up`, a bench that
deploys), joins the one serial group, which runs first and alone on one worker: two local Ray clusters at
once would share the machine's two cores, Serve's ports and /tmp/ray, and the serial group's tests were
written for one cluster at a time. Every other test runs with the rest of its module on the other worker,
so a module's fixtures are built once. Most of a serial test's time is waiting (process starts, streams,
timeouts), which is what the other worker fills.

The group is read from the node id alone, because xdist's scheduler sees only ids (and pytest 9 ignores
the id suffix that xdist's own `xdist_group` mark relies on). tests/conftest.py fails a test outside the
group that leaves Ray initialized in its worker, so a new Ray test cannot silently land beside the
cluster tests.
"""

import os
import sys

import pytest
from xdist.scheduler import LoadScopeScheduling

SERIAL = "ray"
# Whole files or folders whose tests start Ray or `serve run` in a child process.
SERIAL_PATHS = (
    "tests/e2e/",
    "tests/test_external_clients.py",
)
# The limiter's and budgets' backend parameter that starts a module's Ray cluster (tests/limits).
RAY_PARAM = "ray"
# tests/test_benches.py: the benches whose tiny mode starts Ray (a Serve app or the limiter's actors).
RAY_BENCHES = frozenset(
    {"budget_race", "gateway", "http_load", "limiter_flood", "prefix_reuse", "rate_limiter", "routing"}
)


def group_of(nodeid: str) -> str:
    path, _, name = nodeid.partition("::")
    if path.startswith(SERIAL_PATHS):
        return SERIAL
    params = name[name.index("[") + 1 : -1].split("-") if name.endswith("]") and "[" in name else []
    if RAY_PARAM in params:
        return SERIAL
    if path == "tests/test_benches.py" and params and params[0] in RAY_BENCHES:
        return SERIAL
    return path


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
    return ray is not None and bool(ray.is_initialized())
