"""The embedded defaults behind `loraplex up`: database, demo models and public demo adapters, a demo key."""

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import yaml

from adapters.demo_adapters import DEMO_ADAPTERS, build_from_recipe
from adapters.spec import WEIGHTS_FILE
from app.adapter_ingest import AdapterIngest
from app.auth.api_keys import generate_key
from app.bootstrap import adapter_store
from app.demo_assets import shipped_demo
from app.dependency_noise import import_quietly
from app.modelprep.demo_model import Arch, ensure_model
from app.modelprep.demo_skills import SKILLS
from app.modelprep.demo_training import ADAPTERS_DIR, BASE_DIR, RECORD_FILE
from app.served_models.catalog import BaseModelSpec, ModelCatalog
from app.settings import Settings
from billing import adapter_registry, repository
from billing.db import make_engine, make_session_factory, session_scope
from billing.errors import TenantNameTaken
from billing.migrate import upgrade
from billing.models import PUBLIC_OWNER
from deployments.engine.interface import EngineConfig

DEMO_TENANT = "demo"
TRAINED_BASE = BASE_DIR  # the served name whose demo is the trained one (app/demo_assets)
DEMO_KEY_NAME = "demo"  # `up` revokes the keys of this name it minted before: one live demo key at a time


@dataclass(frozen=True)
class DemoSetup:
    tenant_id: str
    api_key: str
    models: dict[str, Path]  # served name -> model directory
    adapters: list[str]  # model names of the public demo adapters


def model_entries(config: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for app in config.get("applications", []) for m in app.get("args", {}).get("models", [])]


def ensure_demo_model(name: str, model_dir: Path) -> Path:
    """The trained demo for `demo-llama` (copied from the shipped one unless already there); `demo-<arch>`
    models of the other archs built (random) when missing; anything else missing is the operator's to
    provide."""
    if name == TRAINED_BASE:
        _place_trained_demo(model_dir)
        return model_dir
    if (model_dir / "config.json").exists():
        return model_dir
    arch = name.removeprefix("demo-")
    if not name.startswith("demo-") or arch not in get_args(Arch):
        raise FileNotFoundError(f"model directory {model_dir} for {name!r} does not exist")
    return ensure_model(model_dir, arch=arch, preset="demo")  # type: ignore[arg-type]


def _place_trained_demo(model_dir: Path) -> bool:
    """Copy the shipped demo model into `model_dir` unless it holds that very one; True if it copied.
    The training record is written last, so an interrupted copy is redone."""
    shipped = shipped_demo() / BASE_DIR
    record = (shipped / RECORD_FILE).read_bytes()
    placed = model_dir / RECORD_FILE
    if placed.exists() and placed.read_bytes() == record:
        return False
    placed.unlink(missing_ok=True)
    shutil.copytree(shipped, model_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns(RECORD_FILE))
    placed.write_bytes(record)
    return True


def prepare(settings: Settings, config_path: Path) -> DemoSetup:
    """Idempotent: migrate, build what is missing, and mint a fresh demo key (keys are shown only once),
    revoking the demo keys earlier runs printed."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    url = settings.resolved_database_url()
    upgrade(url)
    sessions = make_session_factory(make_engine(url))
    specs = {}
    for entry in model_entries(yaml.safe_load(config_path.read_text())):
        engine = EngineConfig(adapter_store=settings.resolved_adapter_store(), **entry["engine"])
        model_dir = ensure_demo_model(entry["name"], engine.model)
        specs[entry["name"]] = BaseModelSpec(
            model_dir,
            engine.max_model_len,
            engine.max_lora_rank,
            engine.lora_target_modules,
            max_num_seqs=engine.max_num_seqs,
        )
    catalog = ModelCatalog.from_specs(specs)
    ingest = AdapterIngest(catalog, adapter_store(settings), sessions)
    adapters: list[str] = []
    for base in catalog:
        if base.name.startswith("demo-"):
            adapters += _ensure_demo_adapters(settings, ingest, sessions, base.name, catalog)
    key = generate_key(settings.resolved_key_secret())
    with session_scope(sessions) as session:
        try:
            tenant = repository.create_tenant(session, name=DEMO_TENANT)
        except TenantNameTaken:
            tenant = next(t for t in repository.list_tenants(session) if t.name == DEMO_TENANT)
        for old in repository.list_api_keys(session, tenant_id=tenant.id):
            if old.name == DEMO_KEY_NAME and old.revoked_at is None:
                repository.revoke_api_key(session, key_id=old.id)
        repository.create_api_key(
            session, tenant_id=tenant.id, prefix=key.prefix, key_hash=key.hash, name=DEMO_KEY_NAME
        )
        tenant_id = tenant.id
    return DemoSetup(
        tenant_id, key.plaintext, {name: spec.model_dir for name, spec in specs.items()}, adapters
    )


def _ensure_demo_adapters(
    settings: Settings, ingest: AdapterIngest, sessions: Any, base_name: str, catalog: ModelCatalog
) -> list[str]:
    """The demo adapters of one demo base model, registered as public adapters: the trained skill adapters
    for `demo-llama`, random ones (built with PEFT) for other demo bases. With several demo bases, each
    base's set is suffixed by the base's name to keep names unique. A shipped adapter whose registered
    weights differ (an earlier release's) gets a new version."""
    base = catalog.get(base_name)
    assert base is not None
    single = len([b for b in catalog if b.name.startswith("demo-")]) == 1
    trained = base_name == TRAINED_BASE
    names = []
    for demo in [s.recipe for s in SKILLS] if trained else DEMO_ADAPTERS:
        name = demo.name if single else f"{demo.name}.{base_name}"
        shipped = shipped_demo() / ADAPTERS_DIR / demo.name
        with sessions() as session:
            live = adapter_registry.find_live(session, owner=PUBLIC_OWNER, name=name)
            current = live is not None and (
                not trained or _live_sha256(session, live.id) == _file_sha256(shipped / WEIGHTS_FILE)
            )
        if not current:
            if trained:
                path = shipped
            else:
                import_quietly("gptqmodel")  # PEFT imports it when installed; it prints a banner
                path = build_from_recipe(demo, base.model_dir, settings.data_dir / "demo-adapters" / name)
            ingest.register_dir(name, PUBLIC_OWNER, base, path)
        names.append(f"public/{name}")
    return names


def _live_sha256(session: Any, adapter_id: str) -> str | None:
    version = adapter_registry.latest_version(session, adapter_id=adapter_id)
    return None if version is None else version.sha256


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
