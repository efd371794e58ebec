"""Engines and sessions for the billing database: a SQLite file by default, PostgreSQL in production.

Nothing is created at import time: callers build the engine from their settings.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import URL, Engine, create_engine, event, make_url
from sqlalchemy.orm import Session, sessionmaker

# Bare PostgreSQL schemes (as hosting providers spell them) would pick psycopg2, which is not installed.
_POSTGRES_SCHEMES = {"postgres", "postgresql"}


def normalize_url(url: str | URL) -> URL:
    """The URL with bare `postgres://` / `postgresql://` pointed at psycopg 3."""
    parsed = make_url(url)
    if parsed.drivername in _POSTGRES_SCHEMES:
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def make_engine(url: str | URL) -> Engine:
    parsed = normalize_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(parsed, pool_pre_ping=True)
    database = parsed.database
    if database and database != ":memory:" and not database.startswith("file:"):
        Path(database).parent.mkdir(parents=True, exist_ok=True)
    # Sessions may hop threads (the ingress runs sync work in a pool); the pool keeps one user per connection.
    engine = create_engine(parsed, connect_args={"check_same_thread": False})
    event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # Per connection: SQLite enforces foreign keys only when asked; WAL lets readers run beside a writer;
    # busy_timeout makes a second writer wait instead of failing at once with "database is locked".
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    # Objects stay readable after commit (e.g. returned to a route after the transaction ends).
    return sessionmaker(bind=engine, expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One transaction: committed when the block ends, rolled back if it raises."""
    with factory() as session, session.begin():
        yield session
