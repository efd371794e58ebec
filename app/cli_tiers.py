"""`loraplex tiers`: pricing tiers, the rate limits they sell and their prices; and the limit options that
`loraplex tenants update` shares with them (a tenant's overrides of its tier's limits).

A limit left unset is unlimited. `--unlimited rpm,tpm` (tiers) and `--clear-overrides rpm,tpm` (tenants)
send those limits as JSON null; everything goes through the admin API (app.cli_http). Prices are sent as
decimal strings, exactly as typed (never through a float).
"""

from decimal import Decimal, InvalidOperation
from enum import StrEnum
from typing import Annotated
from urllib.parse import quote

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from app.cli_http import EXIT_USAGE, JSON, admin_client, emit, fail, fmt_time, stdout

tiers_app = typer.Typer(
    help="Pricing tiers: the rate limits each sells (rpm, tpm, concurrency, max_tokens cap) and its prices.",
    no_args_is_help=True,
)

LIMITS = ("rpm", "tpm", "max_concurrent", "max_tokens_cap")  # as billing.models.LIMIT_FIELDS (not imported:
# the HTTP commands stay free of SQLAlchemy)
_LIMIT_CHOICES = "rpm, tpm, max_concurrent, max_tokens_cap, or all"


class OnLimit(StrEnum):
    REJECT = "reject"
    QUEUE = "queue"


# Options shared by `tiers create|update` and `tenants update`.
RpmOption = Annotated[
    int | None, typer.Option("--rpm", min=1, metavar="N", help="Requests per minute.", show_default=False)
]
TpmOption = Annotated[
    int | None,
    typer.Option(
        "--tpm", min=1, metavar="N", help="Tokens (prompt + completion) per minute.", show_default=False
    ),
]
MaxConcurrentOption = Annotated[
    int | None,
    typer.Option(
        "--max-concurrent", min=1, metavar="N", help="Requests in flight at once.", show_default=False
    ),
]
MaxTokensCapOption = Annotated[
    int | None,
    typer.Option(
        "--max-tokens-cap", min=1, metavar="N", help="Largest max_tokens of one request.", show_default=False
    ),
]


# Prices: option -> API field (billing.models.Tier's columns).
PRICES = {
    "--price-input": "price_input_per_mtok",
    "--price-cached-input": "price_cached_input_per_mtok",
    "--price-output": "price_output_per_mtok",
    "--price-gpu-second": "price_gpu_per_second",
}
PRICE_DECIMALS = 6  # as billing.repository.PRICE_DECIMALS

PriceInputOption = Annotated[
    str | None,
    typer.Option(
        "--price-input",
        metavar="PRICE",
        help="Price per million input tokens, e.g. 0.15.",
        show_default=False,
    ),
]
PriceCachedInputOption = Annotated[
    str | None,
    typer.Option(
        "--price-cached-input",
        metavar="PRICE",
        help="Price per million cached input tokens (prefix-cache hits).",
        show_default=False,
    ),
]
PriceOutputOption = Annotated[
    str | None,
    typer.Option(
        "--price-output", metavar="PRICE", help="Price per million output tokens.", show_default=False
    ),
]
PriceGpuSecondOption = Annotated[
    str | None,
    typer.Option("--price-gpu-second", metavar="PRICE", help="Price per GPU-second.", show_default=False),
]
CurrencyOption = Annotated[
    str | None,
    typer.Option("--currency", metavar="CODE", help="ISO 4217 currency code, e.g. usd.", show_default=False),
]


def price_values(
    price_input: str | None,
    price_cached_input: str | None,
    price_output: str | None,
    price_gpu_second: str | None,
    currency: str | None,
) -> JSON:
    """The price options that were given, by API field name, as decimal strings; exits 2 on a value that
    is not a non-negative decimal with at most 6 decimals."""
    given = zip(
        PRICES.items(), (price_input, price_cached_input, price_output, price_gpu_second), strict=True
    )
    body: JSON = {}
    for (flag, field), value in given:
        if value is not None:
            body[field] = _price(flag, value)
    if currency is not None:
        body["currency"] = currency
    return body


def _price(flag: str, value: str) -> str:
    try:
        price = Decimal(value.strip())
        valid = (
            price.is_finite() and price >= 0 and price == price.quantize(Decimal(1).scaleb(-PRICE_DECIMALS))
        )
    except InvalidOperation:  # not a number, or too large to quantize
        valid = False
    if not valid:
        fail(
            f"{flag}: {value!r} is not a price",
            code=EXIT_USAGE,
            hint=f"give a non-negative decimal with at most {PRICE_DECIMALS} decimals, e.g. 0.15",
        )
    return format(price, "f")


def limit_values(
    rpm: int | None, tpm: int | None, max_concurrent: int | None, max_tokens_cap: int | None
) -> dict[str, int]:
    """The limit options that were given, by API field name."""
    values = dict(zip(LIMITS, (rpm, tpm, max_concurrent, max_tokens_cap), strict=True))
    return {field: value for field, value in values.items() if value is not None}


def limit_names(values: list[str] | None, *, option: str) -> list[str]:
    """`rpm,tpm` (repeatable; `max-concurrent` or `max_concurrent`; `all`) as API field names; exits 2 on
    an unknown one."""
    names: list[str] = []
    for value in values or []:
        for part in value.split(","):
            name = part.strip().lower().replace("-", "_")
            if not name:
                continue
            if name == "all":
                names.extend(LIMITS)
            elif name in LIMITS:
                names.append(name)
            else:
                fail(
                    f"{option}: unknown limit {part.strip()!r}",
                    code=EXIT_USAGE,
                    hint=f"give {_LIMIT_CHOICES}",
                )
    return list(dict.fromkeys(names))


def limits_body(set_to: dict[str, int], cleared: list[str], *, option: str) -> JSON:
    """Limits to set plus limits to send as null; exits 2 if one is both set and cleared."""
    both = [name for name in cleared if name in set_to]
    if both:
        flag = "--" + both[0].replace("_", "-")
        fail(f"{flag} and {option} {both[0]} contradict each other", code=EXIT_USAGE)
    return {**set_to, **dict.fromkeys(cleared)}


def fmt_limit(value: object) -> str:
    """A limit for people: `100,000`, or `unlimited` for none."""
    return f"{value:,}" if isinstance(value, int) else "unlimited"


def fmt_on_limit(limits: JSON) -> str:
    if limits.get("on_limit") == "queue":
        return f"queue up to {limits.get('max_queue_ms')} ms"
    return "reject"


def tenant_limit_rows(tenant: JSON) -> list[tuple[str, object]]:
    """A tenant's effective limits, each marked as its own override or its tier's."""
    limits: JSON = tenant.get("limits") or {}
    rows: list[tuple[str, object]] = []
    for name in LIMITS:
        source = "override" if tenant.get(name) is not None else f"tier {tenant.get('tier')}"
        rows.append((name, f"{fmt_limit(limits.get(name))} ({source})"))
    rows.append(("on_limit", fmt_on_limit(limits)))
    return rows


def _path(name: str) -> str:
    return f"/admin/tiers/{quote(name, safe='')}"


# --- commands --------------------------------------------------------------------------------------------


@tiers_app.command("list")
def tiers_list(ctx: typer.Context) -> None:
    """List the tiers and their limits."""
    emit(ctx, admin_client(ctx).get("/admin/tiers"), _print_tiers)


@tiers_app.command("get")
def tiers_get(
    ctx: typer.Context, name: Annotated[str, typer.Argument(metavar="NAME", help="Tier name.")]
) -> None:
    """Show one tier."""
    emit(ctx, admin_client(ctx).get(_path(name)), lambda tier: stdout().print(_tier_record(tier, "Tier")))


@tiers_app.command("create")
def tiers_create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(metavar="NAME", help="Unique tier name.")],
    rpm: RpmOption = None,
    tpm: TpmOption = None,
    max_concurrent: MaxConcurrentOption = None,
    max_tokens_cap: MaxTokensCapOption = None,
    on_limit: Annotated[
        OnLimit, typer.Option("--on-limit", help="Over a limit: reject at once (429), or queue first.")
    ] = OnLimit.REJECT,
    max_queue_ms: Annotated[
        int,
        typer.Option(
            "--max-queue-ms", min=0, max=60_000, metavar="MS", help="Longest wait in the queue (with queue)."
        ),
    ] = 0,
    description: Annotated[str, typer.Option("--description", help="What the tier is for.")] = "",
    price_input: PriceInputOption = None,
    price_cached_input: PriceCachedInputOption = None,
    price_output: PriceOutputOption = None,
    price_gpu_second: PriceGpuSecondOption = None,
    currency: CurrencyOption = None,
) -> None:
    """Create a tier; a limit not given is unlimited, a price not given is 0 (currency: usd)."""
    body: JSON = {
        "name": name,
        "description": description,
        **limit_values(rpm, tpm, max_concurrent, max_tokens_cap),
        "on_limit": on_limit.value,
        "max_queue_ms": max_queue_ms,
        **price_values(price_input, price_cached_input, price_output, price_gpu_second, currency),
    }
    tier = admin_client(ctx).post("/admin/tiers", body)
    emit(ctx, tier, lambda t: stdout().print(_tier_record(t, "Created tier")))


@tiers_app.command("update")
def tiers_update(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(metavar="NAME", help="Tier name.")],
    rpm: RpmOption = None,
    tpm: TpmOption = None,
    max_concurrent: MaxConcurrentOption = None,
    max_tokens_cap: MaxTokensCapOption = None,
    unlimited: Annotated[
        list[str] | None,
        typer.Option(
            "--unlimited",
            metavar="LIMITS",
            help=f"Make these limits unlimited: comma-separated, {_LIMIT_CHOICES}.",
            show_default=False,
        ),
    ] = None,
    on_limit: Annotated[
        OnLimit | None,
        typer.Option(
            "--on-limit", help="Over a limit: reject at once (429), or queue first.", show_default=False
        ),
    ] = None,
    max_queue_ms: Annotated[
        int | None,
        typer.Option(
            "--max-queue-ms",
            min=0,
            max=60_000,
            metavar="MS",
            help="Longest wait in the queue (with queue).",
            show_default=False,
        ),
    ] = None,
    description: Annotated[
        str | None, typer.Option("--description", help="What the tier is for.", show_default=False)
    ] = None,
    price_input: PriceInputOption = None,
    price_cached_input: PriceCachedInputOption = None,
    price_output: PriceOutputOption = None,
    price_gpu_second: PriceGpuSecondOption = None,
    currency: CurrencyOption = None,
) -> None:
    """Change a tier's limits and prices (only those given); its tenants get new limits within seconds.
    New prices apply to every bill computed afterwards, past periods included."""
    body = limits_body(
        limit_values(rpm, tpm, max_concurrent, max_tokens_cap),
        limit_names(unlimited, option="--unlimited"),
        option="--unlimited",
    )
    others = (("on_limit", on_limit.value if on_limit else None), ("max_queue_ms", max_queue_ms))
    body |= {key: value for key, value in (*others, ("description", description)) if value is not None}
    body |= price_values(price_input, price_cached_input, price_output, price_gpu_second, currency)
    if not body:
        fail(
            "nothing to update",
            code=EXIT_USAGE,
            hint="give a limit (--rpm, --tpm, --max-concurrent, --max-tokens-cap), --unlimited, "
            "--on-limit, --max-queue-ms, --description, a price (--price-input, --price-cached-input, "
            "--price-output, --price-gpu-second) or --currency",
        )
    tier = admin_client(ctx).patch(_path(name), body)
    emit(ctx, tier, lambda t: stdout().print(_tier_record(t, "Updated tier")))


# --- output ----------------------------------------------------------------------------------------------


def _tier_record(tier: JSON, title: str) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=box.SIMPLE)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    rows: list[tuple[str, object]] = [
        ("name", tier.get("name")),
        ("description", tier.get("description")),
        *((name, fmt_limit(tier.get(name))) for name in LIMITS),
        ("on_limit", fmt_on_limit(tier)),
        *_price_rows(tier),
        ("created", fmt_time(tier.get("created_at"))),
    ]
    for field, value in rows:
        table.add_row(field, _cell(value))
    return table


def _price_rows(tier: JSON) -> list[tuple[str, object]]:
    currency = str(tier.get("currency") or "").upper()
    return [
        ("input", f"{tier.get('price_input_per_mtok')} {currency} / 1M tokens"),
        ("cached input", f"{tier.get('price_cached_input_per_mtok')} {currency} / 1M tokens"),
        ("output", f"{tier.get('price_output_per_mtok')} {currency} / 1M tokens"),
        ("gpu", f"{tier.get('price_gpu_per_second')} {currency} / GPU-second"),
    ]


def _print_tiers(listing: JSON) -> None:
    tiers: list[JSON] = listing.get("data", [])
    if not tiers:
        stdout().print("No tiers yet: create one with `loraplex tiers create NAME`.", markup=False)
        return
    table = Table(box=None, header_style="bold", pad_edge=False)  # fits 80 columns; descriptions: `get`
    table.add_column("NAME", overflow="fold", min_width=8)
    for column in ("RPM", "TPM", "CONCURRENT", "MAX TOKENS", "ON LIMIT"):  # numbers stay whole
        table.add_column(column, no_wrap=True)
    for t in tiers:
        on_limit = f"queue {t.get('max_queue_ms')}ms" if t.get("on_limit") == "queue" else "reject"
        limits = [fmt_limit(t.get(name)) for name in LIMITS]
        table.add_row(*map(_cell, (t.get("name"), *limits, on_limit)))
    stdout().print(table)


def _cell(value: object) -> Text:
    """Plain text: names from the API are never read as Rich markup."""
    return Text("-" if value is None or value == "" else str(value))
