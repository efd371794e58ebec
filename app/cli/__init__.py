"""`loraplex`: the admin CLI.

Tiers, tenants, keys, adapters, usage, credit, budgets and routing go through the admin HTTP API, so the
CLI can manage a remote deployment; `db` migrates the billing database directly and `billing` rolls up and
exports usage from it; `up`, `status` and `ready` run the platform locally and follow it.

Each command group is one `typer.Typer()` in its own module of this package (tenants, keys, tiers,
adapters, batches, usage, credit/budgets, billing, routing, db, kernels; `up`/`status` in run, `ready` in
ready);
`build_app()` registers them on the root. A group takes what it shares with others from the helper modules
only, never from another group: app.cli.common (global options, the admin client, emit and fail),
app.cli.output (tables, records, timestamps), app.cli.billing_database (the billing database's URL and
errors) and app.cli.limits (the limit options of tiers and tenants). A new group lives in its own module
and is added to `_groups()`.

Heavy dependencies (torch, transformers, SQLAlchemy, Alembic, Stripe) are imported when a command runs,
never at import time, so that `loraplex --help` and the HTTP commands start quickly.
"""

from typing import Annotated

import typer

from app.cli import ready, run
from app.cli.adapters import adapters_app
from app.cli.batches import batches_app
from app.cli.billing import billing_app
from app.cli.common import DEFAULT_URL, CLIOptions
from app.cli.credit import budgets_app, credit_app
from app.cli.db import db_app
from app.cli.kernels import kernels_app
from app.cli.keys import keys_app
from app.cli.routing import routing_app
from app.cli.tenants import tenants_app
from app.cli.tiers import tiers_app
from app.cli.usage import usage_app
from app.dependency_noise import quiet_dependencies


def _groups() -> list[tuple[str, typer.Typer]]:
    return [
        ("tenants", tenants_app),
        ("batches", batches_app),
        ("keys", keys_app),
        ("tiers", tiers_app),
        ("adapters", adapters_app),
        ("usage", usage_app),
        ("credit", credit_app),
        ("budgets", budgets_app),
        ("billing", billing_app),
        ("routing", routing_app),
        ("db", db_app),
        ("kernels", kernels_app),
    ]


def build_app() -> typer.Typer:
    """The root `loraplex` command with every group registered."""
    root = typer.Typer(name="loraplex", no_args_is_help=True, pretty_exceptions_show_locals=False)
    root.callback()(_global_options)
    for name, group in _groups():
        root.add_typer(group, name=name)
    root.command("up")(run.up)
    root.command("status")(run.status)
    root.command("ready")(ready.ready)
    return root


def main() -> None:
    """Console-script entry point."""
    quiet_dependencies()  # before any command imports torch or transformers
    build_app()(prog_name="loraplex")


def _global_options(
    ctx: typer.Context,
    url: Annotated[
        str, typer.Option("--url", envvar="LORAPLEX_URL", help="Base URL of the platform's HTTP API.")
    ] = DEFAULT_URL,
    admin_key: Annotated[
        str | None,
        typer.Option(
            "--admin-key",
            envvar="LORAPLEX_ADMIN_KEY",
            help="The platform's admin key (its LORAPLEX_ADMIN_KEY).",
            show_default=False,
        ),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print the API's JSON instead of tables.")
    ] = False,
) -> None:
    """Administer a loraplex deployment: tenants and keys over its admin API, migrations on its database.

    Global options go before the command, e.g. `loraplex --json tenants list`.
    """
    ctx.obj = CLIOptions(url=url.rstrip("/"), admin_key=admin_key or None, json=json_output)
