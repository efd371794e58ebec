"""Engines and sessions: URL handling, SQLite's per-connection settings, transaction scope."""

from pathlib import Path

import pytest
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from billing import repository as repo
from billing.db import make_engine, normalize_url, session_scope
from billing.models import ApiKey


@pytest.mark.parametrize(
    ("url", "driver"),
    [
        ("postgres://u:p@db:5432/billing", "postgresql+psycopg"),
        ("postgresql://u@db/billing", "postgresql+psycopg"),
        ("postgresql+psycopg://u@db/billing", "postgresql+psycopg"),
        ("sqlite:////tmp/x.db", "sqlite"),
    ],
)
def test_bare_postgres_urls_get_psycopg(url: str, driver: str) -> None:
    normalized = normalize_url(url)
    assert normalized.drivername == driver
    assert normalized.database in {"billing", "/tmp/x.db"}


def test_postgres_engine_pings_before_use() -> None:
    engine = make_engine("postgres://nobody@localhost/never")  # nothing connects until first use
    assert engine.dialect.driver == "psycopg"
    assert engine.pool._pre_ping


PRAGMAS = ["foreign_keys", "journal_mode", "busy_timeout"]


def test_sqlite_engine_makes_its_directory_and_sets_pragmas(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "billing.db"
    engine = make_engine(f"sqlite:///{path}")
    with engine.connect() as connection:
        pragmas = [connection.exec_driver_sql(f"PRAGMA {name}").scalar() for name in PRAGMAS]
    assert pragmas == [1, "wal", 5000]
    assert path.exists()
    engine.dispose()


def test_session_scope_commits_or_rolls_back(session_factory: sessionmaker[Session]) -> None:
    with session_scope(session_factory) as s:
        kept = repo.create_tenant(s, name="kept")

    def create_then_fail() -> None:
        with session_scope(session_factory) as s:
            repo.create_tenant(s, name="lost")
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        create_then_fail()
    with session_factory() as s:
        assert [t.name for t in repo.list_tenants(s)] == ["kept"]
    assert kept.name == "kept"  # expire_on_commit=False: still readable after the session closed


def test_the_database_enforces_foreign_keys_too(session_factory: sessionmaker[Session]) -> None:
    """Below the repository (which checks first): SQLite only enforces them with the pragma on."""
    with pytest.raises(IntegrityError), session_scope(session_factory) as s:
        s.add(ApiKey(tenant_id="ten_missing", prefix="p" * 12, key_hash="h" * 64))
