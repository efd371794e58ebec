"""Engines and sessions for the billing database: a SQLite file by default, PostgreSQL in production.

Nothing is created at import time: callers build the engine from their settings.
"""

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field
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


class PoolConfig(BaseModel):
    """The connection pool of one process's engine. A request that finds every connection busy waits up to
    `timeout_s`, then fails with sqlalchemy.exc.TimeoutError (the API answers 503 with retry-after)."""

    size: int = Field(default=5, ge=1, description="Connections kept open.")
    max_overflow: int = Field(
        default=10, ge=0, description="Extra connections opened under load, then closed."
    )
    timeout_s: float = Field(
        default=10.0, gt=0, description="How long a caller waits for a free connection before failing."
    )

    def engine_options(self) -> dict[str, Any]:
        return {"pool_size": self.size, "max_overflow": self.max_overflow, "pool_timeout": self.timeout_s}


def make_engine(url: str | URL, pool: PoolConfig | None = None) -> Engine:
    """`pool`: None keeps SQLAlchemy's defaults (CLI and tools); the ingress passes its settings'."""
    parsed = normalize_url(url)
    options = {} if pool is None else pool.engine_options()
    if parsed.get_backend_name() != "sqlite":
        return create_engine(parsed, pool_pre_ping=True, **options)
    database = parsed.database
    if not database or database == ":memory:":
        options = {}  # an in-memory database lives in one connection: not a QueuePool to size
    if database and database != ":memory:" and not database.startswith("file:"):
        _create_private_file(Path(database))
    # Sessions may hop threads (the ingress runs sync work in a pool); the pool keeps one user per connection.
    engine = create_engine(parsed, connect_args={"check_same_thread": False}, **options)
    event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _create_private_file(path: Path) -> None:
    """The database file, created 0600 before SQLite opens it: SQLite would create it under the umask,
    readable by everyone, and gives its -wal/-shm files the database file's mode."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # Per connection: SQLite enforces foreign keys only when asked; WAL lets readers run beside a writer;
    # busy_timeout makes a second writer wait instead of failing at once with "database is locked".
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


def make_session_factory(engine: Engine, *, check: Callable[[], None] | None = None) -> sessionmaker[Session]:
    """`check` runs before every session is made and may refuse it by raising (billing.schema_gate)."""
    # Objects stay readable after commit (e.g. returned to a route after the transaction ends).
    if check is None:
        return sessionmaker(bind=engine, expire_on_commit=False)
    return _CheckedSessions(engine, check)


class _CheckedSessions(sessionmaker[Session]):
    def __init__(self, engine: Engine, check: Callable[[], None]) -> None:
        super().__init__(bind=engine, expire_on_commit=False)
        self._check = check

    def __call__(self, **local_kw: Any) -> Session:
        self._check()
        return super().__call__(**local_kw)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One transaction: committed when the block ends, rolled back if it raises."""
    with factory() as session, session.begin():
        yield session
