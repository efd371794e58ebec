"""`loraplex usage`: tenants' live usage and their bills, through the admin API (app.cli.common).

`usage show` reads GET /admin/usage (live, from the usage events); `usage bill` reads
GET /admin/tenants/{id}/bill (hourly rollups at the costs settled for them). Times are ISO 8601
(`2025-11-01`, `2025-11-01T10:00:00Z`); without an offset they are UTC.
"""

from datetime import UTC, datetime
from decimal import Decimal
from enum import StrEnum
from typing import Annotated
from urllib.parse import urlencode

import typer
from rich.table import Table
from rich.text import Text

from app.cli.common import EXIT_USAGE, JSON, admin_client, emit, fail, segment, stdout

usage_app = typer.Typer(
    help="Tenants' usage (live, per hour, adapter, model or batch) and bills (from hourly rollups).",
    no_args_is_help=True,
)


class GroupBy(StrEnum):
    HOUR = "hour"
    ADAPTER = "adapter"
    MODEL = "model"
    BATCH = "batch"


StartOption = Annotated[
    str,
    typer.Option(
        "--start",
        metavar="TIME",
        help="Start of the period, inclusive (ISO 8601, e.g. 2025-11-01; UTC unless an offset is given).",
        show_default=False,
    ),
]
EndOption = Annotated[
    str,
    typer.Option(
        "--end", metavar="TIME", help="End of the period, exclusive (ISO 8601).", show_default=False
    ),
]


def iso_time(option: str, value: str) -> str:
    """A CLI time as the API's ISO 8601 (UTC when no offset is given); exits 2 when it is not a time."""
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        fail(
            f"{option}: {value!r} is not a time",
            code=EXIT_USAGE,
            hint="give an ISO 8601 date or time, e.g. 2025-11-01 or 2025-11-01T10:00:00Z",
        )
    moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    return moment.isoformat().replace("+00:00", "Z")


@usage_app.command("show")
def usage_show(
    ctx: typer.Context,
    start: StartOption,
    end: EndOption,
    tenant: Annotated[
        str | None,
        typer.Option("--tenant", metavar="ID", help="One tenant; default: every tenant.", show_default=False),
    ] = None,
    group_by: Annotated[
        GroupBy,
        typer.Option("--group-by", help="Rows per UTC hour, per adapter, per base model, or per batch."),
    ] = GroupBy.HOUR,
) -> None:
    """Show usage in [start, end), live from the requests recorded (the current hour included); at most
    93 days."""
    query = {"start": iso_time("--start", start), "end": iso_time("--end", end), "group_by": group_by.value}
    if tenant is not None:
        query["tenant_id"] = tenant
    listing = admin_client(ctx).get(f"/admin/usage?{urlencode(query)}")
    emit(ctx, listing, lambda data: _print_usage(data, by_tenant=tenant is None))


@usage_app.command("bill")
def usage_bill(
    ctx: typer.Context,
    tenant_id: Annotated[str, typer.Argument(metavar="TENANT_ID", help="Tenant ID.")],
    start: StartOption,
    end: EndOption,
) -> None:
    """Show a tenant's bill for the rolled-up hours in [start, end) (whole UTC hours), at the costs
    settled for them (a later price change does not reprice it)."""
    query = urlencode({"start": iso_time("--start", start), "end": iso_time("--end", end)})
    bill = admin_client(ctx).get(f"/admin/tenants/{segment(tenant_id)}/bill?{query}")
    emit(ctx, bill, _print_bill)


# --- output ----------------------------------------------------------------------------------------------

_COUNTS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")


def _print_usage(listing: JSON, *, by_tenant: bool) -> None:
    rows: list[JSON] = listing.get("data", [])
    period = f"{_when(listing.get('start'))} to {_when(listing.get('end'))}"
    if not rows:
        stdout().print(f"No usage from {period}.", markup=False)
        return
    group_by = listing.get("group_by")
    keys = {"hour": ["HOUR"], "model": ["MODEL"], "adapter": ["MODEL", "ADAPTER"], "batch": ["BATCH"]}.get(
        str(group_by), []
    )
    table = _table(
        [*(["TENANT"] if by_tenant else []), *keys], ["REQUESTS", "PROMPT", "CACHED", "COMPLETION", "GPU S"]
    )
    for row in rows:
        groups: dict[str, list[object]] = {
            "hour": [_when(row.get("hour"))],
            "model": [row.get("base_model")],
            "adapter": [row.get("base_model"), row.get("adapter")],
            "batch": [row.get("batch_id") or "interactive"],
        }
        group = groups.get(str(group_by), [])
        tenant = [row.get("tenant_id")] if by_tenant else []
        counts = [_int(row.get(name)) for name in _COUNTS]
        table.add_row(*_cells(*tenant, *group, *counts, _seconds(row.get("gpu_ms"))))
    blanks = [""] * (len(keys) + (1 if by_tenant else 0) - 1)
    totals = [_int(sum(int(row.get(name) or 0) for row in rows)) for name in _COUNTS]
    gpu_ms = sum(float(row.get("gpu_ms") or 0.0) for row in rows)
    table.add_section()
    table.add_row(*_cells("TOTAL", *blanks, *totals, _seconds(gpu_ms)))
    console = stdout()
    console.print(f"Usage from {period}, by {group_by}:", markup=False)
    console.print(table)


def _print_bill(bill: JSON) -> None:
    prices: JSON = bill.get("prices") or {}
    currency = str(bill.get("currency") or "").upper()
    console = stdout()
    console.print(
        f"Bill for tenant {bill.get('tenant_id')} (tier {prices.get('tier')}), "
        f"{_when(bill.get('start'))} to {_when(bill.get('end'))}, in {currency}",
        markup=False,
    )
    console.print(
        f"Current prices per 1M tokens: input {prices.get('input_per_mtok')}, cached input "
        f"{prices.get('cached_input_per_mtok')}, output {prices.get('output_per_mtok')}; "
        f"per GPU-second: {prices.get('gpu_per_second')}; "
        f"per GB-day stored: {prices.get('storage_per_gb_day')}",
        markup=False,
    )
    lines: list[JSON] = bill.get("lines", [])
    totals: JSON = bill.get("totals") or {}
    if not lines:
        console.print("No usage billed in this period (only rolled-up hours are billed).", markup=False)
    else:
        table = _table(["MODEL", "ADAPTER"], ["INPUT", "CACHED", "OUTPUT", "GPU S", "COST"])
        for line in [*lines, None]:
            if line is None:  # the totals, under a rule
                table.add_section()
            source = totals if line is None else line
            names = ["TOTAL", ""] if line is None else [line.get("base_model"), line.get("adapter")]
            table.add_row(
                *_cells(
                    *names,
                    *(_int(source.get(k)) for k in ("input_tokens", "cached_input_tokens", "output_tokens")),
                    source.get("gpu_seconds"),
                    source.get("total"),
                )
            )
        console.print(table)
    console.print(
        f"Input {totals.get('input_cost')}, cached input {totals.get('cached_input_cost')}, "
        f"output {totals.get('output_cost')}, GPU {totals.get('gpu_cost')}, "
        f"storage {totals.get('storage_cost')}, adjustment {totals.get('adjustment')} "
        "(as settled; later prices do not change it)",
        markup=False,
    )
    console.print(f"Total: {totals.get('total')} {currency}", markup=False)


def _table(texts: list[str], numbers: list[str]) -> Table:
    """Numbers right-aligned and never cut; IDs and names fold onto more lines when 80 columns are few."""
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in texts:
        whole = column == "HOUR"
        table.add_column(column, no_wrap=whole, overflow="fold", min_width=None if whole else 8)
    for column in numbers:
        table.add_column(column, justify="right", no_wrap=True)
    return table


def _when(value: object) -> str:
    """An API timestamp as `YYYY-MM-DD HH:MMZ` (UTC)."""
    if not isinstance(value, str):
        return "-"
    try:
        return datetime.fromisoformat(value).astimezone(UTC).strftime("%Y-%m-%d %H:%MZ")
    except ValueError:
        return value


def _int(value: object) -> str:
    return f"{value:,}" if isinstance(value, int) else "-"


def _seconds(gpu_ms: object) -> str:
    """Milliseconds as seconds with 3 decimals (display only; bills carry exact decimal seconds)."""
    if not isinstance(gpu_ms, int | float):
        return "-"
    return f"{Decimal(repr(float(gpu_ms))) / 1000:,.3f}"


def _cells(*values: object) -> list[Text]:
    """Plain text: names from the API are never read as Rich markup. Unlike app.cli.output.cells, only
    None becomes `-`: the blanks of the TOTAL rows stay blank."""
    return [Text("-" if value is None else str(value)) for value in values]
