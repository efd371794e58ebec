"""`loraplex tenants`: who may call the platform and on which tier, their Stripe customer and their
overrides of the tier's limits, through the admin API (app.cli.common). Deleting a tenant disables it:
nothing is erased."""

from typing import Annotated

import typer
from rich.table import Table

from app.cli.common import EXIT_USAGE, JSON, admin_client, confirmed_delete, emit, fail, segment, stdout
from app.cli.limits import (
    LIMIT_CHOICES,
    MaxConcurrentOption,
    MaxTokensCapOption,
    RpmOption,
    TpmOption,
    limit_names,
    limit_values,
    limits_body,
    tenant_limit_rows,
)
from app.cli.output import cells, fmt_time, record, table

tenants_app = typer.Typer(help="Tenants: who may call the platform, and on which tier.", no_args_is_help=True)


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
    tenant = admin_client(ctx).get(f"/admin/tenants/{segment(tenant_id)}")
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
            help=f"Drop these overrides (the tier's values apply again): comma-separated, {LIMIT_CHOICES}.",
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
    tenant = admin_client(ctx).patch(f"/admin/tenants/{segment(tenant_id)}", body)
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
        f"/admin/tenants/{segment(tenant_id)}",
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


# --- output ----------------------------------------------------------------------------------------------


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
    return record(
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
    rows = table("ID", "NAME", "TIER", "STATUS", "CREATED", min_width=6)  # fits 80 columns: names wrap
    for t in tenants:
        rows.add_row(
            *cells(
                t.get("id"),
                t.get("name"),
                t.get("tier"),
                t.get("status"),
                fmt_time(t.get("created_at"), date_only=True),
            )
        )
    stdout().print(rows)
