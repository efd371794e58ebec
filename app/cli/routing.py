"""`loraplex routing show`: adapter hit rate, loads and duplicate loads per base model and replica, from
GET /admin/routing."""

from typing import Annotated
from urllib.parse import urlencode

import typer
from rich.table import Table
from rich.text import Text

from app.cli.common import JSON, admin_client, emit, stdout

routing_app = typer.Typer(
    help="How well requests meet replicas that hold their adapter.", no_args_is_help=True
)


@routing_app.command("show")
def routing_show(
    ctx: typer.Context,
    model: Annotated[
        str | None, typer.Option("--model", help="One base model; default: all.", show_default=False)
    ] = None,
    within: Annotated[
        float | None,
        typer.Option(
            "--within",
            metavar="SECONDS",
            help="Only replicas that reported this recently.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Show routing quality: requests naming an adapter, the share that found it resident (hit rate), adapter
    loads from the store, and loads of a version already loaded on another replica (duplicates)."""
    query: dict[str, str] = {}
    if model is not None:
        query["model"] = model
    if within is not None:
        query["within_s"] = str(within)
    listing = admin_client(ctx).get("/admin/routing" + (f"?{urlencode(query)}" if query else ""))
    emit(ctx, listing, _print_routing)


def _print_routing(listing: JSON) -> None:
    models: list[JSON] = listing.get("data", [])
    console = stdout()
    if not models:
        console.print("No engine replica has reported yet.", markup=False)
        return
    for model in models:
        console.print(
            f"{model.get('base_model')}: hit rate {_rate(model.get('hit_rate'))} over "
            f"{model.get('adapter_requests')} adapter requests, {model.get('loads')} loads, "
            f"{model.get('duplicate_loads')} duplicate loads",
            markup=False,
        )
        table = Table(box=None, header_style="bold", pad_edge=False)
        table.add_column("REPLICA", overflow="fold")
        for name in ("REQUESTS", "HITS", "HIT RATE", "LOADS"):
            table.add_column(name, justify="right", no_wrap=True)
        for replica in model.get("replicas", []):
            table.add_row(
                *(
                    Text(str(value))
                    for value in (
                        replica.get("replica"),
                        replica.get("adapter_requests"),
                        replica.get("adapter_hits"),
                        _rate(replica.get("hit_rate")),
                        replica.get("loads"),
                    )
                )
            )
        console.print(table)


def _rate(value: object) -> str:
    return f"{value:.1%}" if isinstance(value, float) else "-"
