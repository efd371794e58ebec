"""`loraplex up` mints a fresh demo key on every run (a key is shown only once) and revokes the ones it
printed before: one live demo key at a time, not one more per restart."""

import shutil
from pathlib import Path

import pytest

from app.demo import DEMO_KEY_NAME, prepare
from app.settings import Settings
from billing import repository
from billing.db import make_engine, make_session_factory
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
