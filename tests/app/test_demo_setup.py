"""`loraplex up` mints a fresh demo key on every run (a key is shown only once) and revokes the ones it
printed before: one live demo key at a time, not one more per restart."""

import shutil
from pathlib import Path

import pytest

from app.demo import DEMO_KEY_NAME, prepare
from app.demo_assets import shipped_demo
from app.modelprep.demo_model import build_model
from app.modelprep.demo_skills import SKILLS
from app.modelprep.demo_training import BASE_DIR, RECORD_FILE
from app.settings import Settings
from billing import adapter_registry, repository
from billing.db import make_engine, make_session_factory
from billing.models import PUBLIC_OWNER
from tests.app.conftest import ADMIN_KEY

ROOT = Path(__file__).resolve().parents[2]


def test_each_up_revokes_earlier_demo_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # as a new user runs it: the config's relative paths land here
    config = tmp_path / "serve_config.yaml"
    shutil.copy(ROOT / "serve_config.yaml", config)
    settings = Settings(data_dir=tmp_path / "var", database_url="", admin_key=ADMIN_KEY)
    first = prepare(settings, config)
    second = prepare(settings, config)
    assert first.tenant_id == second.tenant_id and first.api_key != second.api_key
    sessions = make_session_factory(make_engine(settings.resolved_database_url()))
    with sessions() as session:
        keys = [
            k for k in repository.list_api_keys(session, tenant_id=first.tenant_id) if k.name == DEMO_KEY_NAME
        ]
    assert len(keys) == 2
    assert [k.revoked_at is None for k in keys] == [False, True]  # the older one revoked, the new one live
    assert keys[1].prefix in second.api_key


def test_up_serves_the_trained_demo_and_registers_each_skill_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "serve_config.yaml"
    shutil.copy(ROOT / "serve_config.yaml", config)
    model_dir = tmp_path / "var" / "models" / "demo-llama"
    build_model(model_dir, preset="tiny")  # an earlier release's random demo model: replaced
    settings = Settings(data_dir=tmp_path / "var", database_url="", admin_key=ADMIN_KEY)
    first = prepare(settings, config)
    assert first.adapters == [f"public/{s.name}" for s in SKILLS]
    shipped = shipped_demo() / BASE_DIR
    for name in ("model.safetensors", "tokenizer.json", "config.json", RECORD_FILE):
        assert (model_dir / name).read_bytes() == (shipped / name).read_bytes(), name
    prepare(settings, config)
    sessions = make_session_factory(make_engine(settings.resolved_database_url()))
    with sessions() as session:
        for skill in SKILLS:
            adapter = adapter_registry.find_live(session, owner=PUBLIC_OWNER, name=skill.name)
            assert adapter is not None
            assert len(adapter_registry.list_versions(session, adapter_id=adapter.id)) == 1
