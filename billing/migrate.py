"""Run the Alembic migrations from code: no alembic.ini, the URL passed in."""

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Connection

import migrations
from billing.db import make_engine, normalize_url
from billing.models import Base

log = logging.getLogger(__name__)


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    config.set_main_option("path_separator", "os")  # without it Alembic warns and splits paths on spaces
    # Not a main option: those go through ConfigParser interpolation, and URLs may hold '%'.
    config.attributes["url"] = url
    # What migrations/env.py needs of billing, handed over so that migrations/ imports nothing of ours.
    config.attributes.update(
        target_metadata=Base.metadata, make_engine=make_engine, normalize_url=normalize_url
    )
    return config


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def current(url: str) -> str | None:
    """The database's revision; None before the first migration."""
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


def head() -> str:
    """The revision this code's migrations end at: what a database must be at to be served."""
    scripts = ScriptDirectory(str(Path(migrations.__file__).parent))
    found = scripts.get_current_head()
    assert found is not None, "the migrations directory has no revisions"
    return found


def is_known(revision: str) -> bool:
    """Whether `revision` is one of this code's migrations (an unknown one was made by newer code)."""
    try:
        return ScriptDirectory(str(Path(migrations.__file__).parent)).get_revision(revision) is not None
    except CommandError:
        return False


def current_on(connection: Connection) -> str | None:
    """The revision of the database behind an open connection; None before the first migration."""
    return MigrationContext.configure(connection).get_current_revision()


def upgrade_to_head(url: str) -> None:
    """Upgrade to head, tolerating a concurrent upgrade by another process (auto_migrate on several
    replicas at once): a failure is an error only if the database did not reach head anyway."""
    before = current(url)
    try:
        upgrade(url)
    except Exception:
        if current(url) != head():
            raise
        log.info("auto_migrate: another process upgraded the database meanwhile")
        return
    log.info("auto_migrate: database upgraded from %s to %s", before or "base", head())
