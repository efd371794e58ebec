"""`loraplex keys`: tenants' API keys, through the admin API (app.cli.common). The secret is printed once,
when the key is created; afterwards only its prefix is ever shown."""

from datetime import UTC, datetime
from typing import Annotated

import typer

from app.cli.common import JSON, admin_client, emit, segment, stdout
from app.cli.output import cells, fmt_time, table

keys_app = typer.Typer(
    help="Tenants' API keys (the secret is shown once, at creation).", no_args_is_help=True
)


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
    created = admin_client(ctx).post(f"/admin/tenants/{segment(tenant_id)}/keys", body)
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
    listing = admin_client(ctx).get(f"/admin/tenants/{segment(tenant_id)}/keys")
    emit(ctx, listing, lambda data: _print_keys(data, tenant_id))


@keys_app.command("revoke")
def keys_revoke(
    ctx: typer.Context, key_id: Annotated[str, typer.Argument(metavar="KEY_ID", help="Key ID (key_...).")]
) -> None:
    """Revoke an API key; it stops working within seconds. Cannot be undone."""
    revoked = admin_client(ctx).delete(f"/admin/keys/{segment(key_id)}")
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
    rows = table("ID", "NAME", "PREFIX", "STATUS", "CREATED", "EXPIRES", min_width=6)  # fits 80 columns
    for key in keys:
        expires = fmt_time(key.get("expires_at"), date_only=True) if key.get("expires_at") else "never"
        rows.add_row(
            *cells(
                key.get("id"),
                key.get("name"),
                key.get("prefix"),
                _key_status(key),
                fmt_time(key.get("created_at"), date_only=True),
                expires,
            )
        )
    stdout().print(rows)
