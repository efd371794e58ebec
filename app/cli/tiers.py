"""`loraplex tiers`: pricing tiers, the rate limits they sell and their prices.

A limit left unset is unlimited; `--unlimited rpm,tpm` sends those limits as JSON null (the limit options,
shared with `loraplex tenants update`, are in app.cli.limits). Everything goes through the admin API
(app.cli.common). Prices are sent as decimal strings, exactly as typed (never through a float).
"""

from decimal import Decimal, InvalidOperation
from enum import StrEnum
from typing import Annotated

import typer
from rich.table import Table

from app.cli.common import EXIT_USAGE, JSON, admin_client, emit, fail, segment, stdout
from app.cli.limits import (
    LIMIT_CHOICES,
    LIMITS,
    MaxConcurrentOption,
    MaxTokensCapOption,
    RpmOption,
    TpmOption,
    fmt_limit,
    fmt_on_limit,
    limit_names,
    limit_values,
    limits_body,
)
from app.cli.output import cells, fmt_time, record

tiers_app = typer.Typer(
    help="Pricing tiers: the rate limits each sells (rpm, tpm, concurrency, max_tokens cap) and its prices.",
    no_args_is_help=True,
)


class OnLimit(StrEnum):
    REJECT = "reject"
    QUEUE = "queue"


# Prices: option -> API field (billing.models.Tier's columns).
PRICES = {
    "--price-input": "price_input_per_mtok",
    "--price-cached-input": "price_cached_input_per_mtok",
    "--price-output": "price_output_per_mtok",
    "--price-gpu-second": "price_gpu_per_second",
}
PRICE_DECIMALS = 6  # as billing.repository.PRICE_DECIMALS
FACTOR_DECIMALS = 4  # as billing.repository.check_price_factor

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
StoredBytesOption = Annotated[
    int | None,
    typer.Option(
        "--max-stored-response-bytes",
        min=1,
        metavar="BYTES",
        help="Each tenant's quota of stored responses (store: true), in bytes; not given: no bound.",
        show_default=False,
    ),
]
BatchPriceFactorOption = Annotated[
    str | None,
    typer.Option(
        "--batch-price-factor",
        metavar="FACTOR",
        help="A Batch API line costs its price times this, 0 to 1 (0.5, the default: half price).",
        show_default=False,
    ),
]
PriceStorageOption = Annotated[
    str | None,
    typer.Option(
        "--price-storage-gb-day",
        metavar="PRICE",
        help="Price per GB (10^9 bytes) a day of each tenant's stored responses and files, charged hourly.",
        show_default=False,
    ),
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
    batch_price_factor: str | None = None,
    price_storage: str | None = None,
) -> JSON:
    """The price options that were given, by API field name, as decimal strings; exits 2 on a price that
    is not a non-negative decimal with at most 6 decimals, or a batch price factor outside 0..1."""
    given = zip(
        PRICES.items(), (price_input, price_cached_input, price_output, price_gpu_second), strict=True
    )
    body: JSON = {}
    for (flag, field), value in given:
        if value is not None:
            body[field] = _price(flag, value)
    if currency is not None:
        body["currency"] = currency
    if batch_price_factor is not None:
        body["batch_price_factor"] = _factor(batch_price_factor)
    if price_storage is not None:
        body["price_storage_per_gb_day"] = _price("--price-storage-gb-day", price_storage)
    return body


def _price(flag: str, value: str) -> str:
    hint = f"give a non-negative decimal with at most {PRICE_DECIMALS} decimals, e.g. 0.15"
    return _decimal(flag, value, places=PRICE_DECIMALS, most=None, noun="a price", hint=hint)


def _factor(value: str) -> str:
    hint = f"give a decimal from 0 to 1 with at most {FACTOR_DECIMALS} decimals, e.g. 0.5"
    flag = "--batch-price-factor"
    return _decimal(flag, value, places=FACTOR_DECIMALS, most=Decimal(1), noun="a price factor", hint=hint)


def _decimal(flag: str, value: str, *, places: int, most: Decimal | None, noun: str, hint: str) -> str:
    """value as a decimal string; exits 2 unless it is finite, from 0 up to `most`, with at most `places`
    decimals: a typo never reaches the API."""
    try:
        number = Decimal(value.strip())
        valid = (
            number.is_finite()
            and number >= 0
            and (most is None or number <= most)
            and number == number.quantize(Decimal(1).scaleb(-places))
        )
    except InvalidOperation:  # not a number, or too large to quantize
        valid = False
    if not valid:
        fail(f"{flag}: {value!r} is not {noun}", code=EXIT_USAGE, hint=hint)
    return format(number, "f")


def _path(name: str) -> str:
    return f"/admin/tiers/{segment(name)}"


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
    batch_price_factor: BatchPriceFactorOption = None,
    price_storage: PriceStorageOption = None,
    weight: Annotated[
        float,
        typer.Option(
            "--weight",
            min=0.001,
            max=1000,
            help="The tier's share of an engine replica while requests wait (2: served twice a 1's).",
        ),
    ] = 1.0,
    max_stored_response_bytes: StoredBytesOption = None,
) -> None:
    """Create a tier; a limit not given is unlimited, a price not given is 0 (currency: usd)."""
    body: JSON = {
        "name": name,
        "description": description,
        **limit_values(rpm, tpm, max_concurrent, max_tokens_cap),
        "on_limit": on_limit.value,
        "max_queue_ms": max_queue_ms,
        **price_values(
            price_input,
            price_cached_input,
            price_output,
            price_gpu_second,
            currency,
            batch_price_factor,
            price_storage,
        ),
        "weight": weight,
        "max_stored_response_bytes": max_stored_response_bytes,
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
            help=f"Make these limits unlimited: comma-separated, {LIMIT_CHOICES}.",
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
    batch_price_factor: BatchPriceFactorOption = None,
    price_storage: PriceStorageOption = None,
    weight: Annotated[
        float | None,
        typer.Option(
            "--weight",
            min=0.001,
            max=1000,
            help="The tier's share of an engine replica while requests wait.",
            show_default=False,
        ),
    ] = None,
    max_stored_response_bytes: StoredBytesOption = None,
    unlimited_stored_responses: Annotated[
        bool,
        typer.Option(
            "--unlimited-stored-responses",
            help="No quota of stored responses (max_stored_response_bytes null).",
            show_default=False,
        ),
    ] = False,
) -> None:
    """Change a tier's limits, weight and prices (only those given); its tenants get new limits within
    seconds. New prices apply from now on: what was settled, and billed, keeps its cost."""
    body = limits_body(
        limit_values(rpm, tpm, max_concurrent, max_tokens_cap),
        limit_names(unlimited, option="--unlimited"),
        option="--unlimited",
    )
    others = (
        ("on_limit", on_limit.value if on_limit else None),
        ("max_queue_ms", max_queue_ms),
        ("weight", weight),
    )
    body |= {key: value for key, value in (*others, ("description", description)) if value is not None}
    body |= price_values(
        price_input,
        price_cached_input,
        price_output,
        price_gpu_second,
        currency,
        batch_price_factor,
        price_storage,
    )
    if max_stored_response_bytes is not None and unlimited_stored_responses:
        fail(
            "--max-stored-response-bytes and --unlimited-stored-responses contradict each other",
            code=EXIT_USAGE,
        )
    if max_stored_response_bytes is not None or unlimited_stored_responses:
        body["max_stored_response_bytes"] = max_stored_response_bytes
    if not body:
        fail(
            "nothing to update",
            code=EXIT_USAGE,
            hint="give a limit (--rpm, --tpm, --max-concurrent, --max-tokens-cap), --unlimited, "
            "--on-limit, --max-queue-ms, --weight, --max-stored-response-bytes, "
            "--unlimited-stored-responses, --description, a price (--price-input, "
            "--price-cached-input, --price-output, --price-gpu-second, --price-storage-gb-day), "
            "--batch-price-factor or --currency",
        )
    tier = admin_client(ctx).patch(_path(name), body)
    emit(ctx, tier, lambda t: stdout().print(_tier_record(t, "Updated tier")))


# --- output ----------------------------------------------------------------------------------------------


def _tier_record(tier: JSON, title: str) -> Table:
    return record(
        title,
        [
            ("name", tier.get("name")),
            ("description", tier.get("description")),
            *((name, fmt_limit(tier.get(name))) for name in LIMITS),
            ("on_limit", fmt_on_limit(tier)),
            ("weight", f"{tier.get('weight', 1.0):g}"),
            ("max_stored_response_bytes", fmt_limit(tier.get("max_stored_response_bytes"))),
            *_price_rows(tier),
            ("created", fmt_time(tier.get("created_at"))),
        ],
    )


def _price_rows(tier: JSON) -> list[tuple[str, object]]:
    currency = str(tier.get("currency") or "").upper()
    return [
        ("input", f"{tier.get('price_input_per_mtok')} {currency} / 1M tokens"),
        ("cached input", f"{tier.get('price_cached_input_per_mtok')} {currency} / 1M tokens"),
        ("output", f"{tier.get('price_output_per_mtok')} {currency} / 1M tokens"),
        ("gpu", f"{tier.get('price_gpu_per_second')} {currency} / GPU-second"),
        ("batch price factor", f"{tier.get('batch_price_factor')} (Batch API lines: price times this)"),
        ("storage", f"{tier.get('price_storage_per_gb_day')} {currency} / GB-day"),
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
        table.add_row(*cells(t.get("name"), *limits, on_limit))
    stdout().print(table)
