"""`loraplex`: the admin CLI.

Tiers, tenants and keys go through the admin HTTP API, so the CLI can manage a remote deployment; `db`
migrates the billing database directly. Each command group is one `typer.Typer()`; `build_app()` registers
them on the root. A new group lives in its own module, takes its client and output helpers from
app.cli_http, and is added to `_groups()`.
"""

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated, TypeVar
from urllib.parse import quote

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from app import cli_ready, cli_run
from app.cli_adapters import adapters_app
from app.cli_billing import billing_app
from app.cli_http import (
    DEFAULT_URL,
    EXIT_USAGE,
    JSON,
    CLIOptions,
    admin_client,
    confirmed_delete,
    emit,
    fail,
    fmt_time,
    stdout,
)
from app.cli_routing import routing_app
from app.cli_tiers import (
    MaxConcurrentOption,
    MaxTokensCapOption,
    RpmOption,
    TpmOption,
    limit_names,
    limit_values,
    limits_body,
    tenant_limit_rows,
    tiers_app,
)
from app.cli_usage import usage_app

T = TypeVar("T")

tenants_app = typer.Typer(help="Tenants: who may call the platform, and on which tier.", no_args_is_help=True)
keys_app = typer.Typer(
    help="Tenants' API keys (the secret is shown once, at creation).", no_args_is_help=True
)
db_app = typer.Typer(
    help="Billing database migrations, run on LORAPLEX_DATABASE_URL directly (not over HTTP).",
    no_args_is_help=True,
)


def _groups() -> list[tuple[str, typer.Typer]]:
    return [
        ("tenants", tenants_app),
        ("keys", keys_app),
        ("tiers", tiers_app),
        ("adapters", adapters_app),
        ("usage", usage_app),
        ("billing", billing_app),
        ("routing", routing_app),
        ("db", db_app),
    ]


def build_app() -> typer.Typer:
    """The root `loraplex` command with every group registered."""
    root = typer.Typer(name="loraplex", no_args_is_help=True, pretty_exceptions_show_locals=False)
    root.callback()(_global_options)
    for name, group in _groups():
        root.add_typer(group, name=name)
    root.command("up")(cli_run.up)
    root.command("status")(cli_run.status)
    root.command("ready")(cli_ready.ready)
    return root


def main() -> None:
    """Console-script entry point."""
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


def _segment(value: str) -> str:
    """A user-given ID as one URL path segment."""
    return quote(value, safe="")


# --- tenants -------------------------------------------------------------------------------------------


@tenants_app.command("create")
def tenants_create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(metavar="NAME", help="Unique tenant name.")],
    tier: Annotated[str, typer.Option(help="Pricing tier.")] = "free",
) -> None:
    """Create a tenant."""
    tenant = admin_client(ctx).post("/admin/tenants", {"name": name, "tier": tier})
    emit(ctx, tenant, lambda t: stdout().print(_tenant_record(t, "Created tenant")))


@tenants_app.command("list")
def tenants_list(ctx: typer.Context) -> None:
    """List all tenants, disabled ones included."""
    emit(ctx, admin_client(ctx).get("/admin/tenants"), _print_tenants)


@tenants_app.command("get")
def tenants_get(
    ctx: typer.Context, tenant_id: Annotated[str, typer.Argument(metavar="TENANT_ID", help="Tenant ID.")]
) -> None:
    """Show one tenant."""
    tenant = admin_client(ctx).get(f"/admin/tenants/{_segment(tenant_id)}")
    emit(ctx, tenant, lambda t: stdout().print(_tenant_record(t, "Tenant")))


@tenants_app.command("update")
def tenants_update(
    ctx: typer.Context,
    tenant_id: Annotated[str, typer.Argument(metavar="TENANT_ID", help="Tenant ID.")],
    name: Annotated[str | None, typer.Option(help="New unique name.", show_default=False)] = None,
    tier: Annotated[str | None, typer.Option(help="New pricing tier.", show_default=False)] = None,
    stripe_customer: Annotated[
        str | None,
        typer.Option(
            "--stripe-customer",
            metavar="CUS_ID",
            help="The Stripe customer its usage is billed to (cus_...).",
            show_default=False,
        ),
    ] = None,
    clear_stripe_customer: Annotated[
        bool, typer.Option("--clear-stripe-customer", help="Bill its usage to no Stripe customer.")
    ] = False,
    rpm: RpmOption = None,
    tpm: TpmOption = None,
    max_concurrent: MaxConcurrentOption = None,
    max_tokens_cap: MaxTokensCapOption = None,
    clear_overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--clear-overrides",
            metavar="LIMITS",
            help="Drop these overrides (the tier's values apply again): comma-separated, "
            "rpm, tpm, max_concurrent, max_tokens_cap, or all.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Rename a tenant, move it to another tier, set its Stripe customer, and/or override its tier's limits
    (within seconds)."""
    body: JSON = {key: value for key, value in (("name", name), ("tier", tier)) if value is not None}
    if stripe_customer is not None and clear_stripe_customer:
        fail("--stripe-customer and --clear-stripe-customer contradict each other", code=EXIT_USAGE)
    if stripe_customer is not None or clear_stripe_customer:
        body["stripe_customer_id"] = stripe_customer  # None (JSON null) clears it
    body |= limits_body(
        limit_values(rpm, tpm, max_concurrent, max_tokens_cap),
        limit_names(clear_overrides, option="--clear-overrides"),
        option="--clear-overrides",
    )
    if not body:
        fail(
            "nothing to update",
            code=EXIT_USAGE,
            hint="give --name, --tier, --stripe-customer, --clear-stripe-customer, a limit override (--rpm, "
            "--tpm, --max-concurrent, --max-tokens-cap) or --clear-overrides",
        )
    tenant = admin_client(ctx).patch(f"/admin/tenants/{_segment(tenant_id)}", body)
    emit(ctx, tenant, lambda t: stdout().print(_tenant_record(t, "Updated tenant")))


@tenants_app.command("delete")
def tenants_delete(
    ctx: typer.Context,
    tenant_id: Annotated[str, typer.Argument(metavar="TENANT_ID", help="Tenant ID.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Disable a tenant and revoke its keys. Nothing is erased: its records and usage history stay."""
    confirmed_delete(
        ctx,
        f"/admin/tenants/{_segment(tenant_id)}",
        yes=yes,
        already_gone=lambda tenant: tenant.get("status") == "disabled",
        question=lambda tenant: (
            f"Disable tenant {tenant.get('name')!r} ({tenant_id})? Its API keys are revoked at once; "
            "its records and usage history are kept."
        ),
        cancelled=f"cancelled: tenant {tenant_id} is unchanged",
        print_already=_print_already_disabled,
        print_done=_print_disabled,
    )


def _print_disabled(tenant: JSON) -> None:
    stdout().print(
        f"Disabled tenant {tenant.get('name')!r} ({tenant.get('id')}); its API keys are revoked. "
        "Its records and usage history are kept.",
        markup=False,
    )


def _print_already_disabled(tenant: JSON) -> None:
    stdout().print(
        f"Tenant {tenant.get('name')!r} ({tenant.get('id')}) is already disabled; nothing to do.",
        markup=False,
    )


def _tenant_record(tenant: JSON, title: str) -> Table:
    return _record(
        title,
        [
            ("id", tenant.get("id")),
            ("name", tenant.get("name")),
            ("tier", tenant.get("tier")),
            ("status", tenant.get("status")),
            ("stripe customer", tenant.get("stripe_customer_id")),
            *tenant_limit_rows(tenant),
            ("created", fmt_time(tenant.get("created_at"))),
            ("updated", fmt_time(tenant.get("updated_at"))),
            ("disabled", fmt_time(tenant.get("disabled_at"))),
        ],
    )


def _print_tenants(listing: JSON) -> None:
    tenants: list[JSON] = listing.get("data", [])
    if not tenants:
        stdout().print("No tenants yet: create one with `loraplex tenants create NAME`.", markup=False)
        return
    table = _table("ID", "NAME", "TIER", "STATUS", "CREATED")
    for t in tenants:
        table.add_row(
            *_cells(
                t.get("id"),
                t.get("name"),
                t.get("tier"),
                t.get("status"),
                fmt_time(t.get("created_at"), date_only=True),
            )
        )
    stdout().print(table)


# --- keys ----------------------------------------------------------------------------------------------


@keys_app.command("create")
def keys_create(
    ctx: typer.Context,
    tenant_id: Annotated[str, typer.Argument(metavar="TENANT_ID", help="Tenant the key belongs to.")],
    name: Annotated[str | None, typer.Option(help="A label for the key.", show_default=False)] = None,
    expires_in_days: Annotated[
        int | None,
        typer.Option(
            "--expires-in-days", help="Days until the key stops working; default: never.", show_default=False
        ),
    ] = None,
) -> None:
    """Create an API key. The secret is printed once: store it now."""
    body = {
        key: value
        for key, value in (("name", name), ("expires_in_days", expires_in_days))
        if value is not None
    }
    created = admin_client(ctx).post(f"/admin/tenants/{_segment(tenant_id)}/keys", body)
    emit(ctx, created, _print_created_key)


def _print_created_key(created: JSON) -> None:
    console = stdout()
    expires = fmt_time(created.get("expires_at"))
    console.print(
        f"Created key {created.get('id')} (prefix {created.get('prefix')}) "
        f"for tenant {created.get('tenant_id')}, expires: {'never' if expires == '-' else expires}.",
        markup=False,
    )
    console.print()
    console.print(f"    {created.get('key')}", markup=False)
    console.print()
    console.print(
        "[bold yellow]Store it now:[/] this is the only time the key is shown; "
        "the platform keeps only a hash."
    )


@keys_app.command("list")
def keys_list(
    ctx: typer.Context, tenant_id: Annotated[str, typer.Argument(metavar="TENANT_ID", help="Tenant ID.")]
) -> None:
    """List a tenant's API keys (prefixes only; secrets are never shown again)."""
    listing = admin_client(ctx).get(f"/admin/tenants/{_segment(tenant_id)}/keys")
    emit(ctx, listing, lambda data: _print_keys(data, tenant_id))


@keys_app.command("revoke")
def keys_revoke(
    ctx: typer.Context, key_id: Annotated[str, typer.Argument(metavar="KEY_ID", help="Key ID (key_...).")]
) -> None:
    """Revoke an API key; it stops working within seconds. Cannot be undone."""
    revoked = admin_client(ctx).delete(f"/admin/keys/{_segment(key_id)}")
    emit(
        ctx,
        revoked,
        lambda key: stdout().print(
            f"Revoked key {key.get('id')} (prefix {key.get('prefix')}) of tenant {key.get('tenant_id')}.",
            markup=False,
        ),
    )


def _key_status(key: JSON) -> str:
    if key.get("revoked_at"):
        return "revoked"
    expires = key.get("expires_at")
    if isinstance(expires, str) and datetime.fromisoformat(expires) <= datetime.now(UTC):
        return "expired"
    return "active"


def _print_keys(listing: JSON, tenant_id: str) -> None:
    keys: list[JSON] = listing.get("data", [])
    if not keys:
        stdout().print(
            f"Tenant {tenant_id} has no keys: create one with `loraplex keys create {tenant_id}`.",
            markup=False,
        )
        return
    table = _table("ID", "NAME", "PREFIX", "STATUS", "CREATED", "EXPIRES")
    for key in keys:
        expires = fmt_time(key.get("expires_at"), date_only=True) if key.get("expires_at") else "never"
        table.add_row(
            *_cells(
                key.get("id"),
                key.get("name"),
                key.get("prefix"),
                _key_status(key),
                fmt_time(key.get("created_at"), date_only=True),
                expires,
            )
        )
    stdout().print(table)


# --- db ------------------------------------------------------------------------------------------------


@db_app.command("upgrade")
def db_upgrade(
    ctx: typer.Context,
    revision: Annotated[str, typer.Argument(metavar="REVISION", help="Target revision.")] = "head",
) -> None:
    """Apply migrations up to a revision (default: head)."""
    from billing import migrate  # here, not at the top: keeps the HTTP commands quick to start

    url, shown = _database_url()
    before = _db(lambda: migrate.current(url), shown, connecting=True)
    _db(lambda: migrate.upgrade(url, revision), shown)
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

    url, shown = _database_url()
    before = _db(lambda: migrate.current(url), shown, connecting=True)
    _db(lambda: migrate.downgrade(url, revision), shown)
    _report_migration(ctx, url, shown, before, "Downgraded")


@db_app.command("current")
def db_current(ctx: typer.Context) -> None:
    """Show the database's revision and whether it is at head."""
    from billing import migrate

    url, shown = _database_url()
    # A SQLite file that is not there yet has no revision; opening it would create it.
    revision = (
        None if _missing_sqlite_file(url) else _db(lambda: migrate.current(url), shown, connecting=True)
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

    after = _db(lambda: migrate.current(url), shown)
    state = {"database": shown, "from": before, "revision": after, "head": _head(url)}

    def human(data: JSON) -> None:
        at = f"{after or 'base'}{' (head)' if after is not None and after == data['head'] else ''}"
        line = (
            f"{shown}: already at {at}" if before == after else f"{verb} {shown}: {before or 'base'} -> {at}"
        )
        stdout().print(line, markup=False)

    emit(ctx, state, human)


def _database_url() -> tuple[str, str]:
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


def _missing_sqlite_file(url: str) -> bool:
    from pathlib import Path

    from sqlalchemy import make_url

    parsed = make_url(url)
    database = parsed.database or ""
    if parsed.get_backend_name() != "sqlite" or database in ("", ":memory:") or database.startswith("file:"):
        return False
    return not Path(database).exists()


def _head(url: str) -> str | None:
    from alembic.script import ScriptDirectory

    from billing import migrate

    return ScriptDirectory.from_config(migrate.alembic_config(url)).get_current_head()


def _db(action: Callable[[], T], shown: str, *, connecting: bool = False) -> T:
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


_NO_WRAP = frozenset({"ID", "PREFIX", "STATUS", "CREATED", "EXPIRES"})


def _table(*columns: str) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in columns:  # IDs and dates stay whole (both tables fit 80 columns); names wrap instead
        whole = column in _NO_WRAP
        table.add_column(column, no_wrap=whole, overflow="fold", min_width=None if whole else 6)
    return table


def _record(title: str, rows: list[tuple[str, object]]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=box.SIMPLE)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for field, value in rows:
        table.add_row(field, *_cells(value))
    return table


def _cells(*values: object) -> list[Text]:
    """Table cells as plain text: names from the API are never read as Rich markup."""
    return [Text("-" if value is None or value == "" else str(value)) for value in values]
