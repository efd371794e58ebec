"""`loraplex credit` and `loraplex budgets`: a tenant's prepaid credit (an append-only ledger: top-ups and
adjustments, with who and why) and its spend limits per UTC day and month, through the admin API."""

from typing import Annotated

import typer

from app.cli.common import JSON, admin_client, emit, segment, stdout
from app.cli.output import record, table

credit_app = typer.Typer(help="Prepaid credit: top-ups, adjustments and the balance.", no_args_is_help=True)
budgets_app = typer.Typer(help="Spend limits per UTC day and month (hard refuses, soft warns).",
                          no_args_is_help=True)  # fmt: skip
TenantArg = Annotated[str, typer.Argument(metavar="TENANT_ID", help="Tenant ID.")]


@credit_app.command("add")
def credit_add(
    ctx: typer.Context,
    tenant_id: TenantArg,
    amount: Annotated[str, typer.Argument(metavar="AMOUNT", help="In the tier's currency, e.g. 25.00.")],
    adjustment: Annotated[
        bool,
        typer.Option(
            "--adjustment",
            help="A correction rather than a top-up (negative only once the tenant is prepaid).",
        ),
    ] = False,
    reason: Annotated[str, typer.Option(help="Why, for the ledger.")] = "",
    actor: Annotated[str, typer.Option(help="Who, for the ledger.")] = "cli",
) -> None:
    """Append a top-up (or, with --adjustment, a correction) to the tenant's credit ledger."""
    body = {
        "amount": amount,
        "kind": "adjustment" if adjustment else "topup",
        "reason": reason,
        "actor": actor,
    }
    entry = admin_client(ctx).post(f"/admin/tenants/{segment(tenant_id)}/credit", body)
    emit(ctx, entry, lambda e: stdout().print(record("Credit entry", [(k, e[k]) for k in
         ("id", "amount", "currency", "kind", "reason", "actor", "surface", "request_id",
          "created_at")])))  # fmt: skip


@credit_app.command("show")
def credit_show(ctx: typer.Context, tenant_id: TenantArg) -> None:
    """The tenant's balance, spend this period, reserved now, limits and its credit ledger."""
    emit(ctx, admin_client(ctx).get(f"/admin/tenants/{segment(tenant_id)}/credit"), _print_budget)


@budgets_app.command("set")
def budgets_set(
    ctx: typer.Context,
    tenant_id: TenantArg,
    day: Annotated[str | None, typer.Option(help="Daily limit (omit: none).", show_default=False)] = None,
    month: Annotated[str | None, typer.Option(help="Monthly limit (omit: none).", show_default=False)] = None,
    soft: Annotated[bool, typer.Option("--soft", help="Only warn past the limits; never refuse.")] = False,
) -> None:
    """Replace the tenant's spend limits; a period not given has none."""
    body: JSON = {
        period: None if value is None else {"amount": value, "hard": not soft}
        for period, value in (("day", day), ("month", month))
    }
    emit(ctx, admin_client(ctx).put(f"/admin/tenants/{segment(tenant_id)}/budgets", body), _print_budget)


def _print_budget(budget: JSON) -> None:
    console = stdout()
    rows = [(k, budget[k]) for k in ("currency", "prepaid", "balance", "reserved", "spent_today",
                                     "spent_this_month", "remaining")]  # fmt: skip
    for period, limit in budget["limits"].items():
        kind = "hard" if limit["hard"] else "soft"
        rows.append((f"{period} limit", f"{limit['amount']} ({kind}), {limit['remaining']} left"))
    for event in budget.get("soft_limit_events") or []:
        rows.append(("soft limit passed", event))
    console.print(record("Budget", rows))
    entries = budget.get("entries")
    if entries:
        listing = table("CREATED", "AMOUNT", "KIND", "ACTOR", "VIA", "REASON", min_width=8)
        for e in entries:
            via = e.get("surface") or "-"  # recorded by the server; the actor is what the caller said
            listing.add_row(e["created_at"], e["amount"], e["kind"], e["actor"], via, e["reason"] or "-")
        console.print(listing)
