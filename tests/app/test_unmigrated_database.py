"""A database at the wrong schema revision (never migrated, or behind): /readyz and every API call say so,
name the revision found and the one expected, and the command that fixes it (issue 14, item 9)."""

import time
from pathlib import Path

import httpx
import pytest

from billing.migrate import head, upgrade
from tests.app.bare_serving import Bare, bare_serving
from tests.model_fixtures import TinySetup

FIX = "loraplex db upgrade"
SOME_KEY = "sk-lp-" + "a" * 12 + "_" + "b" * 43  # well formed: only a database lookup could refuse it


def _not_migrated(r: httpx.Response) -> str:
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "database_not_migrated", error
    assert error["type"] == "server_error"
    assert r.headers["retry-after"]
    message: str = error["message"]
    assert FIX in message and head() in message, message
    return message


def _readiness(bare: Bare) -> httpx.Response:
    return httpx.get(f"{bare.url}/readyz", timeout=30)


def test_a_never_migrated_database_is_not_ready_and_says_why(llama: TinySetup, tmp_path: Path) -> None:
    with bare_serving(llama, tmp_path, migrate=False) as bare:
        r = _readiness(bare)
        assert r.status_code == 503, r.text  # before: 200, "database": "ok"
        database = r.json()["checks"]["database"]
        assert "never migrated" in database and head() in database and FIX in database, database
        message = r.json()["error"]["message"]  # /readyz's own code (not_ready), with the same words
        assert "never migrated" in message and FIX in message, message


def test_api_calls_on_a_never_migrated_database_say_how_to_fix_it(llama: TinySetup, tmp_path: Path) -> None:
    with bare_serving(llama, tmp_path, migrate=False) as bare:
        tenant = httpx.get(f"{bare.url}/v1/models", headers={"authorization": f"Bearer {SOME_KEY}"})
        assert "never migrated" in _not_migrated(tenant)  # before: 503 database_unavailable
        with bare.admin() as admin:
            _not_migrated(admin.get("/admin/tenants"))
            _not_migrated(admin.post("/admin/tenants", json={"name": "early"}))


def test_migrating_while_serving_takes_effect_without_a_restart(llama: TinySetup, tmp_path: Path) -> None:
    with bare_serving(llama, tmp_path, migrate=False) as bare:
        assert _readiness(bare).status_code == 503
        upgrade(bare.database_url)
        deadline = time.monotonic() + 5
        while (r := _readiness(bare)).status_code != 200:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.1)
        _, key = bare.new_tenant("after-upgrade")
        with bare.client(key) as client:
            assert client.get("/v1/models").status_code == 200


def test_a_database_at_an_older_revision_is_reported(llama: TinySetup, tmp_path: Path) -> None:
    upgrade(f"sqlite:///{tmp_path / 'loraplex.db'}", "0003")
    with bare_serving(llama, tmp_path, migrate=False) as bare:
        r = _readiness(bare)
        assert r.status_code == 503, r.text
        database = r.json()["checks"]["database"]
        assert "schema revision 0003" in database and f"expects revision {head()}" in database, database
        with bare.admin() as admin:
            assert "0003" in _not_migrated(admin.get("/admin/tenants"))


@pytest.mark.parametrize("start", [None, "0002"], ids=["fresh", "older"])
def test_auto_migrate_upgrades_at_startup_and_serves(
    llama: TinySetup, tmp_path: Path, start: str | None
) -> None:
    if start is not None:
        upgrade(f"sqlite:///{tmp_path / 'loraplex.db'}", start)
    with bare_serving(llama, tmp_path, migrate=False, auto_migrate=True) as bare:
        r = _readiness(bare)
        assert r.status_code == 200, r.text
        assert r.json()["checks"]["database"] == "ok"
        _, key = bare.new_tenant("auto")
        with bare.client(key) as client:
            assert client.get("/v1/models").status_code == 200
