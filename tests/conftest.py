"""Shared fixtures: billing databases on both backends.

PostgreSQL tests run against the local server (LORAPLEX_TEST_POSTGRES_URL names an admin connection); they
skip when it is unreachable, and fail instead when CI=true, so CI can never go green without them.
"""

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import make_url
from sqlalchemy.orm import Session, sessionmaker

import tests.triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET before the fixtures import Triton)
from billing.db import make_engine, make_session_factory
from billing.migrate import upgrade
from tests.ci import missing
from tests.workers import SERIAL, SerialGroupScheduling, group_of, ray_left_running, serial_first

pytest_plugins = ["tests.model_fixtures"]

POSTGRES_ADMIN_URL = os.environ.get("LORAPLEX_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
_RAY_BEFORE = pytest.StashKey[bool]()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    serial_first(items)


@pytest.hookimpl(optionalhook=True)  # undefined under `-p no:xdist -o addopts=`, which must still load
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> SerialGroupScheduling | None:
    """`--dist loadgroup` (pyproject's addopts): the Ray tests in one unit (tests/workers.py)."""
    return SerialGroupScheduling(config, log) if config.getvalue("dist") == "loadgroup" else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    item.stash[_RAY_BEFORE] = ray_left_running()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """A test outside the serial group that starts Ray fails (tests/workers.py says why)."""
    result = yield
    if not item.stash.get(_RAY_BEFORE, True) and ray_left_running() and group_of(item.nodeid) != SERIAL:
        pytest.fail(f"{item.nodeid} started Ray outside the serial group: name it in tests/workers.py")
    return result


@pytest.fixture(scope="session")
def postgres_admin() -> Iterator[psycopg.Connection]:
    """An autocommit connection to the server, for CREATE/DROP DATABASE."""
    try:
        connection = psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        missing(f"PostgreSQL unreachable at {POSTGRES_ADMIN_URL}: {' '.join(str(exc).split())}")
    with connection:
        yield connection


@pytest.fixture
def postgres_url(postgres_admin: psycopg.Connection) -> Iterator[str]:
    """A fresh, empty database; dropped afterwards."""
    name = f"loraplex_test_{uuid.uuid4().hex[:16]}"
    postgres_admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        url = make_url(POSTGRES_ADMIN_URL).set(drivername="postgresql+psycopg", database=name)
        yield url.render_as_string(hide_password=False)
    finally:  # FORCE: a test that leaked a connection must not leak the database too
        postgres_admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'db' / 'billing.db'}"


_URL_FIXTURES = {"sqlite": "sqlite_url", "postgresql": "postgres_url"}


@pytest.fixture(params=list(_URL_FIXTURES))
def database_url(request: pytest.FixtureRequest) -> str:
    """An empty database on each backend in turn."""
    url: str = request.getfixturevalue(_URL_FIXTURES[request.param])
    return url


@pytest.fixture
def session_factory(database_url: str) -> Iterator[sessionmaker[Session]]:
    """Sessions on a database migrated to head."""
    upgrade(database_url)
    engine = make_engine(database_url)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture(scope="session", autouse=True)
def native_kernel_built() -> None:
    """Build the native CPU LoRA kernel once per machine, before any engine starts (engines only load a
    built one). A machine that cannot build it runs the torch kernels; under CI the kernel tests fail."""
    from deployments.engine.interface import build_native_kernel

    build_native_kernel()
