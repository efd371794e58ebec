"""The HTTP app served for real (uvicorn on a loopback port) over an in-process engine and SQLite.

No Ray here: these tests pin down the HTTP behaviour; tests/e2e runs the same app on Ray Serve.
"""

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import ASGIApp
from typer.testing import Result

from app.bootstrap import build_services
from app.main import create_app
from app.served_models.catalog import BaseModelSpec
from app.services import Services
from app.settings import Settings
from bench.live_server import LiveServer
from billing.adapter_digests import RegistryDigests
from billing.db import make_engine, make_session_factory
from billing.migrate import upgrade
from deployments.engine.async_engine import AsyncEngine
from deployments.engine.config import EngineConfig
from deployments.engine.interface import LocalEngineClient
from deployments.registry_watcher import RegistryWatcher
from tests.model_fixtures import TinySetup

ADMIN_KEY = "admin-test-key-0123456789abcdefghijklmn"  # 32 bytes at least
MODEL = "tiny-llama"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Served:
    url: str
    engine: AsyncEngine
    services: Services
    setup: TinySetup
    data_dir: Path
    app: Any = None  # the FastAPI app (its state: the batch runner), unwrapped

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)

    def break_adapter(self, adapter_id: str) -> None:
        """Corrupt an uploaded adapter's stored weights, and drop what the engine holds of it: the registry
        watcher prefetches an upload (it polls every 0.2 s here), maybe before the corruption (CI once
        answered 200 for such an adapter)."""
        (self.services.store.root / adapter_id / "v1" / "adapter_model.safetensors").write_bytes(b"broken")
        time.sleep(0.5)  # a prefetch in flight has ended
        self.engine.run_on_loop(lambda engine: engine.adapters.remove(adapter_id)).result(timeout=30)

    def new_tenant(self, name: str, tier: str = "free") -> tuple[str, str]:
        """(tenant id, API key) through the admin API."""
        with self.admin() as admin:
            tenant = admin.post("/admin/tenants", json={"name": name, "tier": tier}).json()
            key = admin.post(f"/admin/tenants/{tenant['id']}/keys", json={"name": "test"}).json()
        return tenant["id"], key["key"]


@contextlib.contextmanager
def serving(
    llama: TinySetup,
    data_dir: Path,
    wrap: Callable[[ASGIApp], ASGIApp] | None = None,
    store: str | None = None,
    **settings_overrides: Any,
) -> Iterator[Served]:
    """The app over a fresh in-process engine and SQLite database; `wrap` puts ASGI middleware around it;
    `store`: an adapter store URL in place of the setup's local store (the engine reads it through a node
    cache under data_dir); `settings_overrides`: Settings fields of the ingress."""
    url = f"sqlite:///{data_dir / 'loraplex.db'}"
    upgrade(url)
    settings = Settings(
        data_dir=data_dir,
        database_url=url,
        admin_key=ADMIN_KEY,
        admin_auth_failure_limit=1_000_000,  # many tests probe wrong admin keys; test_admin_auth throttles
        auth_cache_ttl_s=0.2,
        adapter_cache_ttl_s=0.2,
        adapter_store=store or llama.store_root,
        adapter_cache_dir=data_dir / "ingress-cache",
        **settings_overrides,
    )
    engine = AsyncEngine(
        EngineConfig(
            model=llama.model_dir,
            dtype="float32",
            served_model_name=MODEL,
            adapter_store=store or llama.store_root,
            adapter_cache_dir=data_dir / "engine-cache",
            num_kv_blocks=256,
            block_size=4,
            max_num_seqs=16,
            max_num_batched_tokens=128,
        ),
        adapter_digests=RegistryDigests(make_session_factory(make_engine(url))),  # as on a replica
    )
    specs = {MODEL: BaseModelSpec(llama.model_dir)}
    services = build_services(settings, LocalEngineClient({MODEL: engine}), specs)
    watcher = RegistryWatcher(engine, MODEL, services.session_factory, interval_s=0.2)  # as on a replica
    watcher.start()
    app: ASGIApp = create_app(services)
    try:
        with LiveServer(app if wrap is None else wrap(app)) as server:
            yield Served(server.url, engine, services, llama, data_dir, app)
    finally:
        watcher.stop()
        engine.shutdown()


@pytest.fixture(scope="module")
def served(llama: TinySetup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(llama, tmp_path_factory.mktemp("app")) as app:
        yield app


@pytest.fixture(scope="module")
def tenant(served: Served) -> tuple[str, str]:
    return served.new_tenant("acme")


@pytest.fixture
def cli(served: Served, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Result]:
    """Run `loraplex --url <served> --admin-key <key> ARGS...`; the environment cannot leak in."""
    from typer.testing import CliRunner

    from app.cli import build_app

    for name in ("LORAPLEX_URL", "LORAPLEX_ADMIN_KEY"):
        monkeypatch.delenv(name, raising=False)
    runner = CliRunner()

    def invoke(*args: str, input: str | None = None) -> Result:
        return runner.invoke(build_app(), ["--url", served.url, "--admin-key", ADMIN_KEY, *args], input=input)

    return invoke
