"""The HTTP app served for real over any Settings, a SQLite file migrated or not, and no engine.

For what happens before a request reaches an engine (keys, throttles, reads, the database itself), where the
shared `served` fixture's fixed settings and always-migrated database do not fit. The engine client says
its model is loaded and serves nothing.
"""

import contextlib
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Engine, event

from app.bootstrap import build_services
from app.main import create_app
from app.served_models.catalog import BaseModelSpec
from app.services import Services
from app.settings import Settings
from bench.live_server import LiveServer
from billing.migrate import upgrade
from deployments.engine.interface import EngineRequest, RequestOutput
from tests.app.conftest import ADMIN_KEY, MODEL
from tests.model_fixtures import TinySetup


class LoadedEngine:
    """An EngineClient whose model is always loaded; nothing here generates."""

    async def generate(self, base_model: str, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        raise AssertionError("these tests never generate")
        yield  # a generator, as the protocol says

    async def abort(self, base_model: str, request_id: str, replica: str | None) -> bool:
        return False

    async def ready(self, base_model: str) -> bool:
        return True


@dataclass
class Bare:
    url: str
    database_url: str
    services: Services

    @property
    def engine(self) -> Engine:
        bind = self.services.session_factory.kw["bind"]  # type: ignore[attr-defined]
        assert isinstance(bind, Engine)
        return bind

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)

    def new_tenant(self, name: str, tier: str = "free") -> tuple[str, str]:
        """(tenant id, API key) through the admin API."""
        with self.admin() as admin:
            r = admin.post("/admin/tenants", json={"name": name, "tier": tier})
            assert r.status_code == 201, r.text
            tenant = r.json()
            key = admin.post(f"/admin/tenants/{tenant['id']}/keys", json={"name": "test"}).json()
        return tenant["id"], key["key"]

    def client(self, key: str | None = None, *, source: str = "127.0.0.1") -> httpx.Client:
        """A client calling from `source` (any 127.x address reaches the loopback listener)."""
        headers = {} if key is None else {"authorization": f"Bearer {key}"}
        transport = httpx.HTTPTransport(local_address=source)
        return httpx.Client(base_url=self.url, headers=headers, transport=transport, timeout=30)


@contextlib.contextmanager
def bare_serving(
    llama: TinySetup, data_dir: Path, *, migrate: bool = True, **settings: Any
) -> Iterator[Bare]:
    """`settings` override the defaults (the admin key and paths are set here)."""
    url = f"sqlite:///{data_dir / 'loraplex.db'}"
    if migrate:
        upgrade(url)
    full = Settings(
        data_dir=data_dir, database_url=url, admin_key=ADMIN_KEY, adapter_store=llama.store_root, **settings
    )
    services = build_services(full, LoadedEngine(), {MODEL: BaseModelSpec(llama.model_dir)})
    try:
        with LiveServer(create_app(services)) as server:
            yield Bare(server.url, url, services)
    finally:
        services.session_factory.kw["bind"].dispose()  # type: ignore[attr-defined]


@contextlib.contextmanager
def counting(engine: Engine, matches: Callable[[str], bool]) -> Iterator[list[str]]:
    """The SQL statements `engine` runs within the block that `matches` accepts."""
    seen: list[str] = []

    def before(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if matches(statement):
            seen.append(statement)

    event.listen(engine, "before_cursor_execute", before)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", before)


def key_lookups(statement: str) -> bool:
    """A key lookup (authenticator), as opposed to a last_used_at write or anything else."""
    return statement.lstrip().upper().startswith("SELECT") and "FROM api_keys JOIN tenants" in statement
