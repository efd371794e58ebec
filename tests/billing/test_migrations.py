"""Migrations go up and down on both backends, and the models cannot drift from the schema they build."""

import io
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import Script, ScriptDirectory

from billing import repository
from billing.db import make_engine, make_session_factory, session_scope
from billing.migrate import alembic_config, current, downgrade, upgrade
from billing.models import Base, Tenant

BILLING_TABLES = {"tiers", "tenants", "api_keys", "adapters", "adapter_versions"}


def head(url: str) -> str | None:
    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()


def table_names(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def schema_diff(url: str, metadata: sa.MetaData) -> list[Any]:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            return list(compare_metadata(context, metadata))
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(database_url: str) -> None:
    assert current(database_url) is None
    upgrade(database_url)
    assert current(database_url) == head(database_url)
    assert table_names(database_url) >= BILLING_TABLES

    downgrade(database_url, "base")
    assert current(database_url) is None
    assert table_names(database_url) & BILLING_TABLES == set()

    upgrade(database_url)
    assert current(database_url) == head(database_url)


def test_models_match_the_migrated_schema(database_url: str) -> None:
    upgrade(database_url)
    assert schema_diff(database_url, Base.metadata) == []


def test_the_drift_check_sees_drift(database_url: str) -> None:
    """Guards the test above against passing vacuously: a changed length and a new column both show."""
    upgrade(database_url)
    drifted = sa.MetaData(naming_convention=Base.metadata.naming_convention)
    for table in Base.metadata.sorted_tables:
        table.to_metadata(drifted)
    drifted.tables["api_keys"].c.prefix.type = sa.String(16)
    drifted.tables["tenants"].append_column(sa.Column("plan", sa.Text()))
    # Table-level differences are tuples ("add_column", ...); column changes are lists of them.
    diffs = schema_diff(database_url, drifted)
    assert {d[0] if isinstance(d, tuple) else d[0][0] for d in diffs} == {"modify_type", "add_column"}


def test_free_tier_is_seeded(database_url: str) -> None:
    upgrade(database_url)
    engine = make_engine(database_url)
    with session_scope(make_session_factory(engine)) as s:
        free = repository.get_tier(s, name="free")
        assert free.description == "Default tier"
        assert free.created_at.utcoffset() is not None
        assert repository.create_tenant(s, name="first").tier == "free"
    engine.dispose()


@pytest.mark.parametrize("url", ["sqlite:///never-created.db", "postgres://nobody@localhost/never"])
def test_offline_mode_writes_sql(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = alembic_config(url)
    config.output_buffer = io.StringIO()
    command.upgrade(config, "head", sql=True)
    command.downgrade(config, "head:base", sql=True)
    script = config.output_buffer.getvalue()
    assert "CREATE TABLE tenants" in script
    assert "INSERT INTO tiers" in script
    assert "DROP TABLE tiers" in script
    assert list(tmp_path.iterdir()) == []  # offline means no connection, so no SQLite file either


def write_probe_revision(tmp_path: Path, url: str, upgrade_body: str, downgrade_body: str) -> Config:
    """A revision on top of head, made from script.py.mako the way `alembic revision` makes the next one."""
    config = alembic_config(url)
    versions = Path(config.get_main_option("script_location") or "") / "versions"
    config.set_main_option("version_locations", f"{versions}{os.pathsep}{tmp_path}")
    head = ScriptDirectory.from_config(config).get_current_head()
    script = command.revision(config, message="probe", rev_id="probe", version_path=str(tmp_path))
    assert isinstance(script, Script)
    source = Path(script.path).read_text()
    assert f"down_revision: str | Sequence[str] | None = {head!r}" in source
    for name, body in (("upgrade", upgrade_body), ("downgrade", downgrade_body)):
        source = source.replace(f"def {name}() -> None:\n    pass\n", f"def {name}() -> None:\n{body}")
    Path(script.path).write_text(source)
    return config


def test_next_revision_from_the_template_applies(database_url: str, tmp_path: Path) -> None:
    config = write_probe_revision(tmp_path, database_url, "    pass\n", "    pass\n")
    upgrade(database_url)
    command.upgrade(config, "head")
    assert current(database_url) == "probe"
    command.downgrade(config, "-1")
    assert current(database_url) != "probe"


def test_sqlite_batch_migration_keeps_referencing_rows(sqlite_url: str, tmp_path: Path) -> None:
    """SQLite rebuilds a table to alter it; with foreign keys on, dropping the old `tenants` would fail on
    (or cascade into) its API keys. env.py turns them off for the migration and checks afterwards."""
    recreate = '    with op.batch_alter_table("tenants", recreate="always") as batch:\n'
    config = write_probe_revision(
        tmp_path,
        sqlite_url,
        recreate + '        batch.add_column(sa.Column("plan", sa.Text(), nullable=True))\n',
        recreate + '        batch.drop_column("plan")\n',
    )
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    factory = make_session_factory(engine)
    with session_scope(factory) as s:
        tenant = repository.create_tenant(s, name="acme")
        repository.create_api_key(s, tenant_id=tenant.id, prefix="p" * 12, key_hash="h" * 64)

    command.upgrade(config, "head")
    command.downgrade(config, "-1")

    with session_scope(factory) as s:
        assert [k.prefix for k in repository.list_api_keys(s, tenant_id=tenant.id)] == ["p" * 12]
        assert s.get(Tenant, tenant.id) is not None
    with engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    engine.dispose()


def test_0011_dates_existing_prepaid_tenants_from_their_first_credit_entry(database_url: str) -> None:
    """A tenant prepaid before 0010 became so at its first credit entry (where the Stripe export already
    counted its prepaid usage from); a postpaid one stays without a date."""
    upgrade(database_url, "0010")
    engine = make_engine(database_url)
    utc = "+00:00" if engine.dialect.name == "postgresql" else ""  # SQLite keeps UTC text without one
    first, later = f"2026-11-01 09:30:00{utc}", f"2026-11-05 12:00:00{utc}"
    with engine.begin() as connection:
        for tenant, prepaid in (("ten_pre", True), ("ten_post", False)):
            connection.execute(
                sa.text("INSERT INTO tenants (id, name, tier, status, created_at, updated_at, prepaid) "
                        "VALUES (:id, :id, 'free', 'active', :at, :at, :prepaid)"),
                {"id": tenant, "at": first, "prepaid": prepaid},
            )  # fmt: skip
        for entry, at in (("cre_2", later), ("cre_1", first)):
            connection.execute(
                sa.text("INSERT INTO credit_entries (id, tenant_id, amount, currency, kind, reason, actor, "
                        "created_at) VALUES (:id, 'ten_pre', 5, 'usd', 'topup', '', 'ops', :at)"),
                {"id": entry, "at": at},
            )  # fmt: skip
    upgrade(database_url)
    with session_scope(make_session_factory(engine)) as s:
        pre, post = s.get(Tenant, "ten_pre"), s.get(Tenant, "ten_post")
        assert pre is not None and post is not None
        assert pre.prepaid_since == datetime(2026, 11, 1, 9, 30, tzinfo=UTC)
        assert post.prepaid_since is None
    engine.dispose()


def test_0011_gives_existing_rollups_their_rows_currency_and_keeps_their_ids(database_url: str) -> None:
    upgrade(database_url, "0010")
    engine = make_engine(database_url)
    utc = "+00:00" if engine.dialect.name == "postgresql" else ""
    hour, other = f"2026-11-01 09:00:00{utc}", f"2026-11-01 10:00:00{utc}"
    with engine.begin() as connection:
        connection.execute(
            sa.text("INSERT INTO tiers (name, description, created_at, on_limit, max_queue_ms, "
                    "price_input_per_mtok, price_cached_input_per_mtok, price_output_per_mtok, "
                    "price_gpu_per_second, currency, weight) VALUES ('euro', '', :at, 'reject', "
                    "0, 0, 0, 0, 0, 'eur', 1)"), {"at": hour},
        )  # fmt: skip
        connection.execute(
            sa.text("INSERT INTO tenants (id, name, tier, status, created_at, updated_at, prepaid) "
                    "VALUES ('ten_a', 'a', 'euro', 'active', :at, :at, false)"), {"at": hour},
        )  # fmt: skip
        connection.execute(
            sa.text("INSERT INTO usage_events (request_id, tenant_id, key_id, model, base_model, status, "
                    "prompt_tokens, cached_tokens, completion_tokens, gpu_ms, queue_ms, latency_ms, "
                    "started_at, finished_at, recorded_at, cost, currency) VALUES ('r1', 'ten_a', 'k', 'm', "
                    "'m', 'completed', 1, 0, 1, 0, 0, 1, :at, :at, :at, 0.5, 'usd')"),
            {"at": f"2026-11-01 09:59:00{utc}"},
        )  # fmt: skip
        for rid, at in (("ru_old_usd", hour), ("ru_old_none", other)):
            connection.execute(
                sa.text("INSERT INTO usage_rollups (id, tenant_id, adapter_key, base_model, hour, requests, "
                        "prompt_tokens, cached_tokens, completion_tokens, gpu_ms, updated_at, cost_micros) "
                        "VALUES (:id, 'ten_a', 'base', 'm', :at, 1, 1, 0, 1, 0, :at, 500000)"),
                {"id": rid, "at": at},
            )  # fmt: skip
    upgrade(database_url)
    with engine.connect() as connection:
        rows = connection.execute(sa.text("SELECT id, currency FROM usage_rollups ORDER BY id")).all()
    assert [tuple(row) for row in rows] == [("ru_old_none", "eur"), ("ru_old_usd", "usd")]
    engine.dispose()
