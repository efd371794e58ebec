"""`loraplex batches`: every tenant's Batch API batches, through the admin API (app.cli.common): list the
newest, and cancel one (its queued lines never run; running ones finish, then it is cancelled)."""

from datetime import UTC, datetime
from typing import Annotated
from urllib.parse import urlencode

import typer

from app.cli.common import JSON, admin_client, emit, segment, stdout
from app.cli.output import cells, fmt_time, table

batches_app = typer.Typer(help="Batch API batches of every tenant: list and cancel.", no_args_is_help=True)


@batches_app.command("list")
def batches_list(
    ctx: typer.Context,
    tenant: Annotated[
        str | None, typer.Option(help="Only this tenant's (its ID).", show_default=False)
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=100, help="How many, newest first.")] = 20,
) -> None:
    """List the newest batches, with their status and line counts."""
    query: dict[str, str | int] = {"limit": limit}
    if tenant is not None:
        query["tenant_id"] = tenant
    listing = admin_client(ctx).get(f"/admin/batches?{urlencode(query)}")
    emit(ctx, listing, _print_batches)


def _print_batches(listing: JSON) -> None:
    batches: list[JSON] = listing.get("data", [])
    if not batches:
        stdout().print("No batches.")
        return
    rows = table("ID", "TENANT", "STATUS", "ENDPOINT", "DONE+FAILED/TOTAL", "CREATED", min_width=6)
    for batch in batches:
        counts = batch.get("request_counts") or {}
        done = f"{counts.get('completed', 0)}+{counts.get('failed', 0)}/{counts.get('total', 0)}"
        created = datetime.fromtimestamp(batch.get("created_at") or 0, UTC).isoformat()
        rows.add_row(
            *cells(batch.get("id"), batch.get("tenant_id"), batch.get("status"), batch.get("endpoint"), done),
            *cells(fmt_time(created)),
        )
    stdout().print(rows)


@batches_app.command("cancel")
def batches_cancel(
    ctx: typer.Context,
    batch_id: Annotated[str, typer.Argument(metavar="BATCH_ID", help="Batch ID (batch_...).")],
) -> None:
    """Cancel a batch: its queued lines never run (nor are billed); running lines finish first."""
    cancelled = admin_client(ctx).post(f"/admin/batches/{segment(batch_id)}/cancel", {})
    emit(
        ctx,
        cancelled,
        lambda batch: stdout().print(f"Batch {batch.get('id')}: {batch.get('status')}.", markup=False),
    )
