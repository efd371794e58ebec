"""The billing database that `loraplex db` and `loraplex billing` act on directly (not over HTTP):
LORAPLEX_DATABASE_URL, else the SQLite file in LORAPLEX_DATA_DIR.

SQLAlchemy, Alembic and the settings are imported when a command runs, never at import time: the HTTP
commands stay quick to start.
"""

from collections.abc import Callable
from typing import TypeVar

from app.cli.common import EXIT_USAGE, fail

T = TypeVar("T")


def database_url() -> tuple[str, str]:
    """(URL, URL with its password hidden): LORAPLEX_DATABASE_URL, else the SQLite file in the data dir."""
    from pydantic import ValidationError
    from sqlalchemy import make_url
    from sqlalchemy.exc import ArgumentError

    from app.settings import Settings

    try:
        url = Settings().resolved_database_url()
    except ValidationError as exc:
        fail(f"invalid LORAPLEX_* setting: {exc}", code=EXIT_USAGE)
    try:
        shown = make_url(url).render_as_string(hide_password=True)
    except ArgumentError as exc:
        fail(f"invalid database URL: {exc}", code=EXIT_USAGE, hint="set LORAPLEX_DATABASE_URL")
    return url, shown


def missing_sqlite_file(url: str) -> bool:
    """Whether the URL names a SQLite file that is not there yet (opening it would create it)."""
    from pathlib import Path

    from sqlalchemy import make_url

    parsed = make_url(url)
    database = parsed.database or ""
    if parsed.get_backend_name() != "sqlite" or database in ("", ":memory:") or database.startswith("file:"):
        return False
    return not Path(database).exists()


def existing_database() -> tuple[str, str]:
    """The database URL and its shown form; exits 2 if it is a SQLite file that is not there yet."""
    url, shown = database_url()
    if missing_sqlite_file(url):
        fail(f"database {shown} does not exist", code=EXIT_USAGE, hint="run `loraplex db upgrade` first")
    return url, shown


def run_db(action: Callable[[], T], shown: str, *, connecting: bool = False) -> T:
    """Run a database action; errors become a message (exit 2 when the database cannot be opened, else 1)."""
    from alembic.util import CommandError
    from sqlalchemy.exc import DBAPIError, SQLAlchemyError

    try:
        return action()
    except CommandError as exc:
        fail(str(exc))
    except SQLAlchemyError as exc:
        cause = exc.orig if isinstance(exc, DBAPIError) else exc
        detail = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        if connecting:
            fail(
                f"cannot open database {shown}: {detail}", code=EXIT_USAGE, hint="check LORAPLEX_DATABASE_URL"
            )
        fail(f"database error on {shown}: {detail}")
