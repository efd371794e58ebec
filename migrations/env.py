"""Alembic environment: the billing models' metadata, SQLite and PostgreSQL, online and offline.

billing/migrate.py runs these scripts and hands them what they need in `config.attributes` (the URL, the
models' metadata, its engine factory), so migrations/ imports nothing of ours: billing -> migrations is
the one direction (docs/architecture.md).
"""

from collections.abc import Callable
from typing import Any

from alembic import context
from sqlalchemy import URL, Connection, Engine, MetaData

config = context.config


def _given(name: str) -> Any:
    if name not in config.attributes:
        raise RuntimeError(f"no {name}: run migrations through billing.migrate (`loraplex db upgrade`)")
    return config.attributes[name]


target_metadata: MetaData = _given("target_metadata")
make_engine: Callable[[str], Engine] = _given("make_engine")
normalize_url: Callable[[str], URL] = _given("normalize_url")


def database_url() -> str:
    return str(_given("url"))


def run_migrations_offline() -> None:
    context.configure(
        url=normalize_url(database_url()),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=True,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(database_url())
    try:
        with engine.connect() as connection:
            if connection.dialect.name == "sqlite":
                _run_sqlite(connection)
            else:
                _run(connection)
    finally:
        engine.dispose()


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection, target_metadata=target_metadata, render_as_batch=True, compare_type=True
    )
    with context.begin_transaction():
        context.run_migrations()


def _run_sqlite(connection: Connection) -> None:
    # A batch migration copies a table and drops the original; with foreign keys on, that DROP deletes
    # (or fails on) every row that references it. So: off for the migration (the pragma is ignored inside
    # a transaction, hence before it), then check that nothing dangles, then back on.
    connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
    connection.commit()
    try:
        _run(connection)
        dangling = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
        connection.commit()
        if dangling:
            raise RuntimeError(f"migration left rows with dangling foreign keys: {dangling}")
    finally:
        connection.exec_driver_sql("PRAGMA foreign_keys=ON")
        connection.commit()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
