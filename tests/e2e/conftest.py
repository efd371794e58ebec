"""A real Ray Serve application in this test session: local Ray, Serve HTTP proxy on a loopback port,
the builder from serve_config.yaml's import path, two base models (tiny Llama and tiny Qwen2)."""

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from ray import serve

from billing.migrate import upgrade
from deployments.builder import build_app
from tests.app.conftest import ADMIN_KEY, free_port
from tests.model_fixtures import TinySetup

APP_NAME = "loraplex"


def engine_settings(setup: TinySetup, **overrides: Any) -> dict[str, Any]:
    """No adapter_store: every engine uses the platform's one store (LORAPLEX_ADAPTER_STORE)."""
    return {
        "model": str(setup.model_dir),
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
    metrics_url: str = ""  # the node's Prometheus export (Ray's metrics agent)

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)

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


def serve_status_wait(timeout: float = 120) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = serve.status().applications.get(APP_NAME)
        if status is not None and status.status == "RUNNING":
            return
        time.sleep(0.5)
    raise TimeoutError(f"application not running: {serve.status()}")


@pytest.fixture(scope="session")
def serve_app(
    tiny_setups: dict[str, TinySetup], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeApp]:
    data_dir = tmp_path_factory.mktemp("serve")
    database_url = f"sqlite:///{data_dir / 'loraplex.db'}"
    upgrade(database_url)
    env = {
        "RAY_AUTH_MODE": "disabled",  # Ray 2.60 turns token auth on for new local clusters
        "LORAPLEX_DATA_DIR": str(data_dir),
        "LORAPLEX_DATABASE_URL": database_url,
        "LORAPLEX_ADMIN_KEY": ADMIN_KEY,
        "LORAPLEX_AUTH_CACHE_TTL_S": "0.2",
        "LORAPLEX_ADAPTER_STORE": str(data_dir / "adapters"),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the local cluster's workers inherit this process's environment
    port, metrics_port = free_port(), free_port()
    ray.init(address="local", include_dashboard=False, num_cpus=2, log_to_driver=False,
             runtime_env={"env_vars": env}, _metrics_export_port=metrics_port)  # fmt: skip
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = ServeApp(
        f"http://127.0.0.1:{port}", data_dir, tiny_setups, f"http://127.0.0.1:{metrics_port}/metrics"
    )
    app.deploy(
        {
            "models": [
                {"name": "tiny-llama", "engine": engine_settings(tiny_setups["llama"])},
                {"name": "tiny-qwen2", "engine": engine_settings(tiny_setups["qwen2"])},
            ]
        }
    )
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
