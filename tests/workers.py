"""How the suite splits across pytest-xdist's workers (`-n 2 --dist loadgroup`, pyproject's addopts).

A test that starts Ray, in this process (a fixture) or in a child (`serve run`, `loraplex up`, a bench that
deploys), joins the one serial group, which runs first and alone on one worker: two local Ray clusters at
once would share the machine's two cores, Serve's ports and /tmp/ray, and the serial group's tests were
written for one cluster at a time. Every other test runs with the rest of its module on the other worker,
so a module's fixtures are built once. Most of a serial test's time is waiting (process starts, streams,
timeouts), which is what the other worker fills.

`serial_guard` (an autouse fixture in tests/conftest.py) fails a test outside the group that leaves Ray
running in its worker, so a new Ray test cannot silently land beside the cluster tests.
"""

import os
import sys

import pytest

SERIAL = "ray"
# Whole files or folders whose tests start Ray or `serve run` in a child process.
SERIAL_PATHS = (
    "tests/e2e/",
    "tests/test_external_clients.py",
)
# Fixtures that start a local Ray cluster in the test's own process.
RAY_FIXTURES = frozenset({"serve_app", "ray_actors", "ray_limiter"})
# tests/test_benches.py: the benches whose tiny mode starts Ray (a Serve app or the limiter's actors).
RAY_BENCHES = frozenset(
    {"budget_race", "gateway", "http_load", "limiter_flood", "prefix_reuse", "rate_limiter", "routing"}
)


def group_of(item: pytest.Item) -> str:
    path = item.nodeid.split("::", 1)[0]
    if path.startswith(SERIAL_PATHS) or RAY_FIXTURES & set(getattr(item, "fixturenames", ())):
        return SERIAL
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "ray" in params.values():  # the limiter's and budgets' backends: "ray" starts a module cluster
        return SERIAL
    if path == "tests/test_benches.py" and params.get("bench") in RAY_BENCHES:
        return SERIAL
    return path


def assign_groups(items: list[pytest.Item]) -> None:
    """Mark each test with its group; on a worker, the serial group first (every worker sorts alike), so
    the scheduler hands it out before anything else and it never waits at the end."""
    groups = {item.nodeid: group_of(item) for item in items}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: groups[item.nodeid] != SERIAL)  # stable: collection order otherwise


def ray_left_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())
