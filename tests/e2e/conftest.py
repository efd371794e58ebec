"""A real Ray Serve application in this test session: local Ray, Serve HTTP proxy on a loopback port,
the builder from serve_config.yaml's import path, two base models (tiny Llama and tiny Qwen2).

Its billing database is PostgreSQL under CI (a fresh database on the test server), as in production;
elsewhere SQLite unless LORAPLEX_TEST_E2E_DATABASE=postgres. The in-process HTTP tests (tests/app) and
`loraplex up` (tests/e2e/test_readme_run.py) keep SQLite covered end to end."""

import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import ray
from psycopg import sql
from ray import serve
from sqlalchemy import make_url
from sqlalchemy.orm import Session, sessionmaker

from bench.load.incidents import postgres_outage, sqlite_outage
from billing.db import make_engine, make_session_factory
from billing.migrate import upgrade
from deployments.builder import build_app
from tests.app.conftest import ADMIN_KEY, free_port
from tests.ci import is_ci
from tests.conftest import POSTGRES_ADMIN_URL
from tests.model_fixtures import TinySetup


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep each phase's report on the test (item.rep_setup, .rep_call): fixtures that print diagnostics
    when a test failed read them."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


APP_NAME = "loraplex"
T = TypeVar("T")


def engine_settings(setup: TinySetup, **overrides: Any) -> dict[str, Any]:
    """No adapter_store: every engine uses the platform's one store (LORAPLEX_ADAPTER_STORE)."""
    return {
        "model": str(setup.model_dir),
        "dtype": "float32",  # outputs are compared with fp32 references
        "num_kv_blocks": 256,
        "block_size": 4,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 128,
        "max_loras": 4,
        **overrides,
    }


@dataclass
class ServeApp:
    url: str
    data_dir: Path
    setups: dict[str, TinySetup]
    database_url: str
    metrics_url: str = ""  # the node's Prometheus export (Ray's metrics agent)
    admin_url: str = ""  # the ingress's separate admin listener (LORAPLEX_ADMIN_LISTEN)
    postgres_database: str | None = None  # the database's name when it is PostgreSQL

    def sessions(self) -> "sessionmaker[Session]":
        return make_session_factory(make_engine(self.database_url))

    def database_outage(self) -> contextlib.AbstractContextManager[None]:
        """While held, the billing database cannot be written: SQLite is locked, PostgreSQL refuses
        connections and has every open one terminated."""
        if self.postgres_database is not None:
            return postgres_outage(POSTGRES_ADMIN_URL, self.postgres_database)
        return sqlite_outage(self.data_dir / "loraplex.db")

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.admin_url, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
        )

    def new_tenant(self, name: str, tier: str = "free") -> tuple[str, str]:
        with self.admin() as admin:
            tenant = admin.post("/admin/tenants", json={"name": name, "tier": tier})
            tenant.raise_for_status()
            key = admin.post(f"/admin/tenants/{tenant.json()['id']}/keys", json={})
            key.raise_for_status()
        return tenant.json()["id"], key.json()["key"]

    def engine_handle(self, model: str) -> Any:
        return serve.get_deployment_handle(f"engine-{model}", app_name=APP_NAME)

    def deploy(self, args: dict[str, Any]) -> None:
        serve.run(build_app(args), name=APP_NAME, route_prefix="/", blocking=False)
        serve_status_wait()

    def deploy_default(self) -> None:
        """The app as the session starts it: both tiny models on default engine settings."""
        self.deploy({"models": [
            {"name": "tiny-llama", "engine": engine_settings(self.setups["llama"])},
            {"name": "tiny-qwen2", "engine": engine_settings(self.setups["qwen2"])},
        ]})  # fmt: skip


def in_background(delay_s: float, fault: Callable[[], T]) -> "Future[T]":
    """Run `fault` in another thread after `delay_s`; `.result()` returns its value or raises its error, so
    a fault that failed to happen fails the test instead of becoming a warning."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fault")

    def later() -> T:
        time.sleep(delay_s)
        return fault()

    future = pool.submit(later)
    pool.shutdown(wait=False)
    return future


def wait_for(check: Callable[[], T | None], what: str, timeout: float = 90.0, every: float = 0.25) -> T:
    """Poll `check` until it returns a value that is neither None nor False; that value. Fails naming `what`
    after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (value := check()) is None or value is False:
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(every)
    return value


async def sse_events(
    client: httpx.AsyncClient, body: dict[str, Any], on_event: Callable[[], object] = lambda: None
) -> list[dict[str, Any]]:
    """POST a streaming /v1/completions and return its JSON events; `on_event` runs at each."""
    events = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                on_event()
    return events


def serve_status_wait(timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = serve.status().applications.get(APP_NAME)
        if status is not None and status.status == "RUNNING":
            return
        time.sleep(0.5)
    raise TimeoutError(f"application not running: {serve.status()}")


def _on_postgres() -> bool:
    return is_ci() or os.environ.get("LORAPLEX_TEST_E2E_DATABASE") == "postgres"


@pytest.fixture(scope="session")
def serve_database(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not _on_postgres():
        yield f"sqlite:///{tmp_path_factory.mktemp('serve-db') / 'loraplex.db'}"
        return
    admin = request.getfixturevalue("postgres_admin")
    name = f"loraplex_e2e_{uuid.uuid4().hex[:12]}"
    admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        url = make_url(POSTGRES_ADMIN_URL).set(drivername="postgresql+psycopg", database=name)
        yield url.render_as_string(hide_password=False)
    finally:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def serve_app(
    tiny_setups: dict[str, TinySetup], serve_database: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeApp]:
    data_dir = tmp_path_factory.mktemp("serve")
    database_url = serve_database
    if database_url.startswith("sqlite"):  # the data dir's own file, as `loraplex up` lays it out
        database_url = f"sqlite:///{data_dir / 'loraplex.db'}"
    upgrade(database_url)
    admin_port = free_port()
    env = {
        "RAY_AUTH_MODE": "disabled",  # Ray 2.60 turns token auth on for new local clusters
        "LORAPLEX_DATA_DIR": str(data_dir),
        "LORAPLEX_DATABASE_URL": database_url,
        "LORAPLEX_ADMIN_KEY": ADMIN_KEY,
        "LORAPLEX_AUTH_CACHE_TTL_S": "0.2",
        "LORAPLEX_ADAPTER_STORE": str(data_dir / "adapters"),
        # /admin on a listener of its own, as operators who firewall it run it; the tenant port has none.
        "LORAPLEX_ADMIN_LISTEN": f"127.0.0.1:{admin_port}",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the local cluster's workers inherit this process's environment
    port, metrics_port = free_port(), free_port()
    ray.init(address="local", include_dashboard=False, num_cpus=2, log_to_driver=False,
             runtime_env={"env_vars": env}, _metrics_export_port=metrics_port)  # fmt: skip
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = ServeApp(
        f"http://127.0.0.1:{port}",
        data_dir,
        tiny_setups,
        database_url,
        f"http://127.0.0.1:{metrics_port}/metrics",
        postgres_database=None if database_url.startswith("sqlite") else make_url(database_url).database,
        admin_url=f"http://127.0.0.1:{admin_port}",
    )
    app.deploy_default()
    try:
        yield app
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]  # unannotated in Ray
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
