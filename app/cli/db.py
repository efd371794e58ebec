"""`loraplex db`: migrations of the billing database, run on it directly (app.cli.billing_database), not over
HTTP. Alembic and the migrations are imported when a command runs: the HTTP commands stay quick to start."""

from typing import Annotated

import typer

from app.cli.billing_database import database_url, missing_sqlite_file, run_db
from app.cli.common import JSON, emit, stdout

db_app = typer.Typer(
    help="Billing database migrations, run on LORAPLEX_DATABASE_URL directly (not over HTTP).",
    no_args_is_help=True,
)


@db_app.command("upgrade")
def db_upgrade(
    ctx: typer.Context,
    revision: Annotated[str, typer.Argument(metavar="REVISION", help="Target revision.")] = "head",
) -> None:
    """Apply migrations up to a revision (default: head)."""
    from billing import migrate  # here, not at the top: keeps the HTTP commands quick to start

    url, shown = database_url()
    before = run_db(lambda: migrate.current(url), shown, connecting=True)
    run_db(lambda: migrate.upgrade(url, revision), shown)
    _report_migration(ctx, url, shown, before, "Upgraded")


# ignore_unknown_options: a relative revision such as -1 is the argument, not an unknown option.
@db_app.command("downgrade", context_settings={"ignore_unknown_options": True})
def db_downgrade(
    ctx: typer.Context,
    revision: Annotated[
        str,
        typer.Argument(metavar="REVISION", help="Target revision: an ID, -1 (one step), or base (undo all)."),
    ],
) -> None:
    """Undo migrations down to a revision. Dropped tables lose their data."""
    from billing import migrate

    url, shown = database_url()
    before = run_db(lambda: migrate.current(url), shown, connecting=True)
    run_db(lambda: migrate.downgrade(url, revision), shown)
    _report_migration(ctx, url, shown, before, "Downgraded")


@db_app.command("current")
def db_current(ctx: typer.Context) -> None:
    """Show the database's revision and whether it is at head."""
    from billing import migrate

    url, shown = database_url()
    # A SQLite file that is not there yet has no revision; opening it would create it.
    revision = (
        None if missing_sqlite_file(url) else run_db(lambda: migrate.current(url), shown, connecting=True)
    )
    state = {"database": shown, "revision": revision, "head": _head(url)}
    emit(ctx, state, _print_current)


def _print_current(state: JSON) -> None:
    revision, head = state["revision"], state["head"]
    if revision is None:
        line = f"{state['database']}: no migrations applied (run `loraplex db upgrade`)"
    elif revision == head:
        line = f"{state['database']}: {revision} (head)"
    else:
        line = f"{state['database']}: {revision}; head is {head} (run `loraplex db upgrade`)"
    stdout().print(line, markup=False)


def _report_migration(ctx: typer.Context, url: str, shown: str, before: str | None, verb: str) -> None:
    from billing import migrate

    after = run_db(lambda: migrate.current(url), shown)
    state = {"database": shown, "from": before, "revision": after, "head": _head(url)}

    def human(data: JSON) -> None:
        at = f"{after or 'base'}{' (head)' if after is not None and after == data['head'] else ''}"
        line = (
            f"{shown}: already at {at}" if before == after else f"{verb} {shown}: {before or 'base'} -> {at}"
        )
        stdout().print(line, markup=False)

    emit(ctx, state, human)


def _head(url: str) -> str | None:
    from alembic.script import ScriptDirectory

    from billing import migrate

    return ScriptDirectory.from_config(migrate.alembic_config(url)).get_current_head()
