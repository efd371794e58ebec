"""The embedded defaults behind `loraplex up`: database, demo models and adapters, a demo tenant and key."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import yaml

from adapters.demo_adapters import DEMO_ADAPTERS, build_from_recipe
from adapters.store import AdapterStore
from app.auth import generate_key
from app.settings import Settings
from billing import repository
from billing.db import make_engine, make_session_factory, session_scope
from billing.errors import TenantNameTaken
from billing.migrate import upgrade
from deployments.engine.demo_model import Arch, ensure_model

DEMO_TENANT = "demo"


@dataclass(frozen=True)
class DemoSetup:
    tenant_id: str
    api_key: str
    models: dict[str, Path]  # served name -> model directory
    adapters: dict[str, str]  # adapter name -> "id@vN" in the store


def model_entries(config: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for app in config.get("applications", []) for m in app.get("args", {}).get("models", [])]


def ensure_demo_model(name: str, model_dir: Path) -> Path:
    """Build `demo-<arch>` models that are missing; anything else missing is the operator's to provide."""
    if (model_dir / "config.json").exists():
        return model_dir
    arch = name.removeprefix("demo-")
    if not name.startswith("demo-") or arch not in get_args(Arch):
        raise FileNotFoundError(f"model directory {model_dir} for {name!r} does not exist")
    return ensure_model(model_dir, arch=arch, preset="demo")  # type: ignore[arg-type]


def prepare(settings: Settings, config_path: Path) -> DemoSetup:
    """Idempotent: migrate, build what is missing, and mint a fresh demo key (keys are shown only once)."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    url = settings.resolved_database_url()
    upgrade(url)
    config = yaml.safe_load(config_path.read_text())
    models: dict[str, Path] = {}
    adapters: dict[str, str] = {}
    store = AdapterStore(settings.resolved_adapter_store())
    for entry in model_entries(config):
        model_dir = ensure_demo_model(entry["name"], Path(entry["engine"]["model"]))
        models[entry["name"]] = model_dir
        if entry["name"].startswith("demo-"):
            adapters.update(_ensure_demo_adapters(settings, store, entry["name"], model_dir))
    sessions = make_session_factory(make_engine(url))
    key = generate_key(settings.resolved_key_secret())
    with session_scope(sessions) as session:
        try:
            tenant = repository.create_tenant(session, name=DEMO_TENANT)
        except TenantNameTaken:
            tenant = next(t for t in repository.list_tenants(session) if t.name == DEMO_TENANT)
        repository.create_api_key(
            session, tenant_id=tenant.id, prefix=key.prefix, key_hash=key.hash, name="demo"
        )
        tenant_id = tenant.id
    return DemoSetup(tenant_id=tenant_id, api_key=key.plaintext, models=models, adapters=adapters)


def _ensure_demo_adapters(
    settings: Settings, store: AdapterStore, base: str, model_dir: Path
) -> dict[str, str]:
    """The demo adapters for one demo base model, built with PEFT and stored once."""
    refs = {}
    for demo in DEMO_ADAPTERS:
        adapter_id = f"{base}--{demo.name}"
        if not store.versions(adapter_id):
            path = build_from_recipe(demo, model_dir, settings.data_dir / "demo-adapters" / adapter_id)
            store.put_dir(adapter_id, path)
        refs[demo.name] = str(store.latest(adapter_id))
    return refs
