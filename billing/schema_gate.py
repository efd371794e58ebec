"""SchemaGate: no session on a database whose schema is behind this code's, but a clear error instead.

A fresh database that was never migrated answers `SELECT 1` but has no tables: without the gate /readyz said
ok and every call failed as "database unavailable". The gate reads the Alembic revision before the first
session; once it is at head it does not read it again (a flag check per session) until a statement fails
as a missing table would (OperationalError, ProgrammingError): then the next session re-reads it, at most
once per `recheck_s`, so a database recreated or restored under a running replica is named as such instead
of every call failing as "database unavailable". While it is behind, it re-reads at most every
`recheck_s`, so running `loraplex db upgrade` takes effect without a restart.
"""

import logging
import threading
import time

from sqlalchemy import Engine, event
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.exc import OperationalError, ProgrammingError

from billing import migrate

UPGRADE_COMMAND = "loraplex db upgrade"
log = logging.getLogger(__name__)


class DatabaseNotMigrated(Exception):
    """The database's schema revision is not the one this code expects."""

    def __init__(self, found: str | None, expected: str) -> None:
        self.found = found
        self.expected = expected
        at = f"schema revision {found}" if found else "no schema revision (never migrated)"
        super().__init__(
            f"The billing database is at {at}; this version expects revision {expected}. Run "
            f"`{UPGRADE_COMMAND}` with LORAPLEX_DATABASE_URL naming it (or set LORAPLEX_AUTO_MIGRATE=true "
            "on a single node)."
        )


class SchemaGate:
    def __init__(self, engine: Engine, *, recheck_s: float = 1.0) -> None:
        self._engine = engine
        self._recheck_s = recheck_s
        self._lock = threading.Lock()
        self._current = False
        self._refusal: DatabaseNotMigrated | None = None
        self._next_check = 0.0
        event.listen(engine, "handle_error", self._doubt)

    def require(self) -> None:
        """Return if the schema is at head; else raise DatabaseNotMigrated (connection errors propagate)."""
        if self._current:
            return
        with self._lock:  # one reader at a time: the rest take its answer
            if self._current:
                return
            if time.monotonic() < self._next_check:  # checked a moment ago: that answer stands
                if self._refusal is not None:
                    raise self._refusal
                return
            self._refusal = self._check()
            self._next_check = time.monotonic() + self._recheck_s
            if self._refusal is not None:
                raise self._refusal
            self._current = True

    def _doubt(self, context: ExceptionContext) -> None:
        # A lost connection says nothing about the schema; a statement the database refused might.
        if isinstance(context.sqlalchemy_exception, OperationalError | ProgrammingError) and not (
            context.is_disconnect
        ):
            self._current = False

    def _check(self) -> DatabaseNotMigrated | None:
        with self._engine.connect() as connection:
            found = migrate.current_on(connection)
        expected = migrate.head()
        if found == expected:
            return None
        if found is not None and not migrate.is_known(found):
            # Newer code migrated it (a rolling upgrade): its schema is a superset we cannot judge; serve.
            log.warning("database schema revision %s is newer than this code's %s; serving", found, expected)
            return None
        return DatabaseNotMigrated(found, expected)
