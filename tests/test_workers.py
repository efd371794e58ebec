"""The split of the suite over xdist's workers (tests/workers.py): which node ids join the serial group."""

import pytest

from tests.workers import SERIAL, group_of


@pytest.mark.parametrize(
    ("nodeid", "group"),
    [
        ("tests/e2e/test_serving.py::test_x", SERIAL),
        ("tests/e2e/test_cluster_e2e.py::test_y[a-b]", SERIAL),
        ("tests/test_external_clients.py::test_z", SERIAL),
        ("tests/limits/test_backends.py::test_a[ray]", SERIAL),
        ("tests/limits/test_backends.py::test_a[ray-0.5]", SERIAL),
        ("tests/limits/test_backends.py::test_a[redis-0.5]", "tests/limits/test_backends.py"),
        ("tests/limits/test_backends.py::test_a[array]", "tests/limits/test_backends.py"),
        ("tests/test_benches.py::test_the_bench_runs_in_its_tiny_mode[routing]", "tests/test_benches.py"),
        ("tests/app/test_cli.py::test_b", "tests/app/test_cli.py"),
    ],
)
def test_the_serial_group_is_the_e2e_modules_and_in_process_ray(nodeid: str, group: str) -> None:
    assert group_of(nodeid) == group
