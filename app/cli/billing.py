"""`loraplex billing`: hourly usage rollups and the Stripe Billing Meters export.

Like `db`, these act on the billing database directly (LORAPLEX_DATABASE_URL, else the SQLite file in
LORAPLEX_DATA_DIR), not over HTTP; Stripe is configured by LORAPLEX_STRIPE_* (billing.stripe_config).
Times are ISO 8601 on whole hours (`2025-11-01`, `2025-11-01T10:00Z`); without an offset they are UTC.

Exit codes: 0 done; 1 events left undelivered (export) or totals that disagree (reconcile), or Stripe refused;
2 bad options or settings, or the database or Stripe could not be reached.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from app.cli.billing_database import existing_database, run_db
from app.cli.common import EXIT_API_ERROR, EXIT_USAGE, JSON, emit, fail, stdout

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from billing.stripe_config import StripeConfig

billing_app = typer.Typer(
    help="Usage rollups and the Stripe meter export, run on LORAPLEX_DATABASE_URL directly (not over HTTP).",
    no_args_is_help=True,
)


@billing_app.command("rollup")
def billing_rollup(
    ctx: typer.Context,
    hours: Annotated[
        int,
        typer.Option("--hours", min=1, max=24 * 366, help="How many hours back, the current one included."),
    ] = 24,
) -> None:
    """Recompute the hourly rollups of the last N hours from the usage events (late events included)."""
    from billing.usage import hour_of, rollup_hours

    end = hour_of(datetime.now(UTC)) + timedelta(hours=1)
    start = end - timedelta(hours=hours)
    url, shown = existing_database()

    def recompute() -> int:
        with _sessions(url) as factory, factory() as session, session.begin():
            return rollup_hours(session, start=start, end=end)

    rows = run_db(recompute, shown, connecting=True)
    state = {"database": shown, "start": _iso(start), "end": _iso(end), "rollups": rows}
    emit(
        ctx,
        state,
        lambda s: stdout().print(
            f"Recomputed {s['rollups']} rollup(s) for {_shown(start)} .. {_shown(end)} in {shown}.",
            markup=False,
        ),
    )


@billing_app.command("export")
def billing_export(ctx: typer.Context) -> None:
    """Send what grew in closed hours to Stripe's meters; exit 1 if any event is left undelivered."""
    from billing.stripe_export import export_usage

    config = _stripe_config()
    if not config.enabled:
        fail(
            "the Stripe export is disabled: LORAPLEX_STRIPE_API_KEY is empty",
            code=EXIT_USAGE,
            hint="set LORAPLEX_STRIPE_API_KEY to a key that may write meter events",
        )
    url, shown = existing_database()

    def run() -> JSON:
        with _sessions(url) as factory, _export_progress() as progress:
            task = progress.add_task("sending meter events to Stripe", total=None)

            def advance(done: int, total: int) -> None:
                progress.update(task, completed=done, total=total)

            return export_usage(factory, config, on_progress=advance).as_dict()

    summary = run_db(run, shown, connecting=True)
    emit(ctx, {"database": shown, **summary}, _print_export)
    if summary["failed"]:
        raise typer.Exit(EXIT_API_ERROR)


def _export_progress() -> Progress:
    """A bar on stderr (stdout stays the summary or --json), gone when the export ends."""
    return Progress(
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True, highlight=False),
        transient=True,
    )


def _print_export(summary: JSON) -> None:
    console = stdout()
    console.print(
        f"Stripe export from {summary['database']}: {summary['sent']} sent "
        f"({summary['duplicates']} already at Stripe), {summary['failed']} failed, "
        f"{summary['skipped']} skipped (older than 35 days), {summary['prepaid']} not invoiced (prepaid); "
        f"{summary['created']} new, "
        f"{summary['pending']} still pending.",
        markup=False,
    )
    if summary["failed"]:
        console.print(
            "[dim]hint:[/] failed events stay pending and are retried by the next run; "
            "their last error is in stripe_exports.last_error"
        )


@billing_app.command("reconcile")
def billing_reconcile(
    ctx: typer.Context,
    start: Annotated[str, typer.Option("--start", metavar="TIME", help="First hour, inclusive.")],
    end: Annotated[str, typer.Option("--end", metavar="TIME", help="Last hour, exclusive.")],
    no_stripe: Annotated[
        bool,
        typer.Option("--no-stripe", help="Compare the database with the export log only, not with Stripe."),
    ] = False,
) -> None:
    """Compare per customer and meter: rollups, the export log and (when configured) Stripe's summaries;
    and per tenant and UTC day: the spend settled into the usage rows against the same rows repriced from
    the price history, to the cent (and no row left unpriced).

    Exit 1 when any total disagrees. Stripe aggregates asynchronously: right after an export it may lag.
    """
    import stripe

    from billing.stripe_export import make_client, reconcile

    first, last = _hour_option(start, "--start"), _hour_option(end, "--end")
    if last <= first:
        fail("--end must be after --start", code=EXIT_USAGE)
    config = _stripe_config()
    client = make_client(config) if config.enabled and not no_stripe else None
    url, shown = existing_database()

    def compare() -> tuple[list[JSON], list[JSON]]:
        from billing.spend_reconcile import reconcile_spend

        with _sessions(url) as factory, factory() as session:
            found = reconcile(session, start=first, end=last, config=config, client=client)
            spend = reconcile_spend(session, start=first, end=last)
            return [d.as_dict() for d in found], [d.as_dict() for d in spend]

    try:
        found, spend = run_db(compare, shown, connecting=True)
    except stripe.APIConnectionError as exc:
        fail(
            f"cannot reach Stripe: {exc.user_message or exc}",
            code=EXIT_USAGE,
            hint="check LORAPLEX_STRIPE_API_BASE",
        )
    except stripe.StripeError as exc:
        fail(f"Stripe refused: {exc.user_message or exc} (HTTP {exc.http_status})")
    state = {"database": shown, "start": _iso(first), "end": _iso(last), "stripe_checked": client is not None,
             "discrepancies": found, "spend_discrepancies": spend}  # fmt: skip
    emit(ctx, state, _print_reconcile)
    if found or spend:
        raise typer.Exit(EXIT_API_ERROR)


def _print_reconcile(state: JSON) -> None:
    _print_stripe_reconcile(state)
    period = f"{_shown(state['start'])} .. {_shown(state['end'])}"
    spend: list[JSON] = state["spend_discrepancies"]
    if not spend:
        stdout().print(f"Settled spend matches the price history to the cent for {period}.", markup=False)
        return
    listing = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("TENANT", "DAY", "SETTLED", "REPRICED", "UNPRICED"):
        listing.add_column(column, no_wrap=True)
    for d in spend:
        listing.add_row(*(Text(str(d[k])) for k in ("tenant_id", "day", "settled", "repriced", "unpriced")))
    stdout().print(f"{len(spend)} spend discrepancies for {period}:", markup=False)
    stdout().print(listing)


def _print_stripe_reconcile(state: JSON) -> None:
    sources = "database, export log" + (" and Stripe" if state["stripe_checked"] else "")
    period = f"{_shown(state['start'])} .. {_shown(state['end'])}"
    found: list[JSON] = state["discrepancies"]
    if not found:
        stdout().print(f"No discrepancies for {period} ({sources} agree).", markup=False)
        return
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("CUSTOMER", "METER", "DATABASE", "SENT", "SKIPPED", "PENDING", "STRIPE"):
        numeric = column not in ("CUSTOMER", "METER")
        table.add_column(column, justify="right" if numeric else "left", no_wrap=True)
    for d in found:
        cells = (d["customer"], d["meter"], d["db"], d["sent"], d["skipped"], d["pending"], d["stripe"])
        table.add_row(*(Text("-" if value is None else str(value)) for value in cells))
    console = stdout()
    noun = "discrepancy" if len(found) == 1 else "discrepancies"
    console.print(f"{len(found)} {noun} for {period} ({sources}):", markup=False)
    console.print(table)


# --- helpers -------------------------------------------------------------------------------------------


@contextmanager
def _sessions(url: str) -> "Iterator[sessionmaker[Session]]":
    from billing.db import make_engine, make_session_factory

    engine = make_engine(url)
    try:
        yield make_session_factory(engine)
    finally:
        engine.dispose()


def _stripe_config() -> "StripeConfig":
    from pydantic import ValidationError

    from billing.stripe_config import StripeConfig

    try:
        return StripeConfig()
    except ValidationError as exc:
        fail(f"invalid LORAPLEX_STRIPE_* setting: {exc}", code=EXIT_USAGE)


def _hour_option(value: str, option: str) -> datetime:
    """An ISO 8601 time on a whole hour, as an aware UTC datetime (no offset: UTC)."""
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        fail(f"{option}: {value!r} is not an ISO 8601 time", code=EXIT_USAGE, hint="e.g. 2025-11-01T10:00Z")
    moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    if moment != moment.replace(minute=0, second=0, microsecond=0):
        fail(f"{option}: {value!r} is not on a whole hour", code=EXIT_USAGE, hint="rollups are hourly")
    return moment


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def _shown(moment: datetime | str) -> str:
    parsed = datetime.fromisoformat(moment) if isinstance(moment, str) else moment
    return parsed.astimezone(UTC).strftime("%Y-%m-%d %H:%MZ")
