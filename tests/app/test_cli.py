"""`loraplex` CLI against the live app (HTTP commands) and a temporary SQLite file (db commands)."""

import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from alembic.script import ScriptDirectory
from typer.testing import CliRunner, Result

from app.cli import build_app
from billing import repository
from billing.migrate import alembic_config
from tests.app.conftest import ADMIN_KEY, Served, free_port
from tests.app.helpers import as_json, unique


def models_status(served: Served, key: str) -> int:
    return httpx.get(f"{served.url}/v1/models", headers={"authorization": f"Bearer {key}"}).status_code


def test_tenant_lifecycle(cli: Callable[..., Result], served: Served) -> None:
    name = unique("cli")
    tenant = as_json(cli("--json", "tenants", "create", name))
    assert tenant["name"] == name
    assert tenant["tier"] == "free"
    assert tenant["status"] == "active"

    listed = as_json(cli("--json", "tenants", "list"))
    assert tenant["id"] in {t["id"] for t in listed["data"]}
    human = cli("tenants", "list")
    assert human.exit_code == 0, human.output
    assert tenant["id"] in human.stdout
    assert name in human.stdout

    got = cli("tenants", "get", tenant["id"])
    assert got.exit_code == 0, got.output
    assert tenant["id"] in got.stdout
    assert "active" in got.stdout

    tier = unique("pro")  # made in the database directly
    with served.services.session_factory() as session, session.begin():
        repository.create_tier(session, name=tier)
    renamed = unique("cli-renamed")
    updated = as_json(cli("--json", "tenants", "update", tenant["id"], "--name", renamed, "--tier", tier))
    assert (updated["name"], updated["tier"]) == (renamed, tier)
    nothing = cli("tenants", "update", tenant["id"])
    assert nothing.exit_code == 2
    assert "nothing to update" in nothing.stderr

    declined = cli("tenants", "delete", tenant["id"], input="n\n")
    assert declined.exit_code == 1
    assert "usage history are kept" in declined.stderr  # the question says what disabling does
    assert "cancelled" in declined.stderr
    assert as_json(cli("--json", "tenants", "get", tenant["id"]))["status"] == "active"

    deleted = cli("tenants", "delete", tenant["id"], input="y\n")
    assert deleted.exit_code == 0, deleted.output
    assert "Disabled" in deleted.stdout
    disabled = as_json(cli("--json", "tenants", "get", tenant["id"]))
    assert disabled["status"] == "disabled"
    assert disabled["disabled_at"] is not None
    again = as_json(cli("--json", "tenants", "delete", tenant["id"], "--yes"))  # idempotent, kept
    assert again["id"] == tenant["id"]


def test_key_lifecycle(cli: Callable[..., Result], served: Served) -> None:
    tenant = as_json(cli("--json", "tenants", "create", unique("keys")))

    created = cli("keys", "create", tenant["id"], "--name", "ci", "--expires-in-days", "30")
    assert created.exit_code == 0, created.output
    assert "Store it now" in created.stdout
    key = next(word for word in created.stdout.split() if word.startswith("sk-lp-"))
    assert models_status(served, key) == 200

    as_dict = as_json(cli("--json", "keys", "create", tenant["id"]))
    assert as_dict["key"].startswith("sk-lp-")
    assert as_dict["expires_at"] is None

    listed = as_json(cli("--json", "keys", "list", tenant["id"]))
    assert len(listed["data"]) == 2
    assert all("key" not in k for k in listed["data"])  # the secret is never listed
    first = next(k for k in listed["data"] if k["name"] == "ci")
    assert first["expires_at"] is not None
    human = cli("keys", "list", tenant["id"])
    assert human.exit_code == 0, human.output
    assert first["prefix"] in human.stdout
    assert key not in human.stdout

    revoked = cli("keys", "revoke", first["id"])
    assert revoked.exit_code == 0, revoked.output
    assert "Revoked" in revoked.stdout
    deadline = time.monotonic() + 2
    while models_status(served, key) != 401:
        assert time.monotonic() < deadline, "revoked key still works after 2 s"
        time.sleep(0.05)
    assert models_status(served, as_dict["key"]) == 200
    statuses = {
        k["id"]: k["revoked_at"] for k in as_json(cli("--json", "keys", "list", tenant["id"]))["data"]
    }
    assert statuses[first["id"]] is not None
    assert statuses[as_dict["id"]] is None


def test_api_errors_print_the_message_and_exit_1(cli: Callable[..., Result]) -> None:
    name = unique("dup")
    assert cli("tenants", "create", name).exit_code == 0
    duplicate = cli("tenants", "create", name)
    assert duplicate.exit_code == 1
    assert f"tenant name '{name}' is already taken" in duplicate.stderr
    assert "409" in duplicate.stderr
    assert duplicate.stdout == ""
    assert "Traceback" not in duplicate.output

    missing = cli("--json", "keys", "list", "ten_nosuchtenant")
    assert missing.exit_code == 1
    assert "not found" in missing.stderr
    assert "404" in missing.stderr


def test_wrong_admin_key_exits_1_with_a_hint(served: Served) -> None:
    result = CliRunner().invoke(build_app(), ["--url", served.url, "--admin-key", "wrong", "tenants", "list"])
    assert result.exit_code == 1
    assert "Invalid admin key" in result.stderr
    assert "LORAPLEX_ADMIN_KEY" in result.stderr


def test_url_and_admin_key_come_from_the_environment(served: Served) -> None:
    env = {"LORAPLEX_URL": served.url, "LORAPLEX_ADMIN_KEY": ADMIN_KEY}
    result = CliRunner().invoke(build_app(), ["--json", "tenants", "list"], env=env)
    assert as_json(result)["object"] == "list"


def test_unreachable_platform_exits_2_with_a_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAPLEX_URL", raising=False)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = CliRunner().invoke(build_app(), ["--url", url, "--admin-key", "k", "tenants", "list"])
    assert result.exit_code == 2
    assert f"cannot reach {url}: is the platform running? (set --url or LORAPLEX_URL)" in result.stderr
    assert "Traceback" not in result.output


def test_missing_admin_key_exits_2_and_says_how_to_set_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAPLEX_ADMIN_KEY", raising=False)
    result = CliRunner().invoke(build_app(), ["tenants", "list"])
    assert result.exit_code == 2
    assert "--admin-key" in result.stderr
    assert "LORAPLEX_ADMIN_KEY" in result.stderr


def test_db_upgrade_current_downgrade(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", f"sqlite:///{tmp_path / 'cli.db'}")
    runner = CliRunner()

    def db(*args: str) -> Result:
        return runner.invoke(build_app(), ["db", *args])

    assert as_json(runner.invoke(build_app(), ["--json", "db", "current"]))["revision"] is None
    assert not (tmp_path / "cli.db").exists()  # looking did not create the file

    head = ScriptDirectory.from_config(alembic_config(os.environ["LORAPLEX_DATABASE_URL"])).get_current_head()
    upgraded = db("upgrade")
    assert upgraded.exit_code == 0, upgraded.output
    assert f"base -> {head} (head)" in upgraded.stdout
    state = as_json(runner.invoke(build_app(), ["--json", "db", "current"]))
    assert state["revision"] == state["head"] == head
    assert f"{head} (head)" in db("current").stdout
    assert f"already at {head}" in db("upgrade").stdout

    downgraded = db("downgrade", "base")
    assert downgraded.exit_code == 0, downgraded.output
    assert f"{head} -> base" in downgraded.stdout
    assert "no migrations applied" in db("current").stdout

    unknown = db("upgrade", "nosuchrevision")
    assert unknown.exit_code == 1
    assert "nosuchrevision" in unknown.stderr
    assert "Traceback" not in unknown.output


def test_ready_waits_for_readyz_and_names_what_is_not_ready(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    ok = CliRunner().invoke(build_app(), ["--url", served.url, "--json", "ready", "--wait", "5"])
    assert ok.exit_code == 0, ok.output
    assert as_json(ok)["checks"]["database"] == "ok"

    async def not_loaded(base_model: str) -> bool:
        return False

    monkeypatch.setattr(served.services.engine, "ready", not_loaded)
    waiting = CliRunner().invoke(build_app(), ["--url", served.url, "ready", "--wait", "1.5"])
    assert waiting.exit_code == 1
    assert "not ready after 1.5s: engine:tiny-llama: failed" in waiting.stderr

    nobody = CliRunner().invoke(
        build_app(), ["--url", f"http://127.0.0.1:{free_port()}", "ready", "--wait", "0"]
    )
    assert nobody.exit_code == 1 and "unreachable" in nobody.stderr
