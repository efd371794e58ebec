"""Bills: a tenant's usage over a period at the costs settled for it, in exact decimal arithmetic.

A bill is computed from the hourly rollups (billing.usage), not from the raw events: rollups are what the
Stripe exporter meters, and an hour's rollup stops changing once the hour is closed
(billing.usage.closed_before) and rolled up. So a bill over closed, rolled-up hours is reproducible from
the database alone: the same period gives the same bill tomorrow, whatever prices change in between. Hours
not yet rolled up are simply absent; the live view is billing.usage_queries.

The period is [start, end) in whole UTC hours: the rollups whose hour starts at or after `start` and
before `end`.

What is billed is what was settled (issue 35): each usage row's cost is fixed when it settles, at the
prices the request was admitted at, and a rollup's `cost_micros` sums its rows' costs; that is what the
Stripe cost meter exports (billing.stripe_export.meter_values). A line's `total` is the sum of its
rollups' `cost_micros`, so a price change never reprices a past bill and every bill equals what was
exported. The parts (input, cached input, output, GPU time) split that total at the price history: each
rollup's quantities at the prices in force at the start of its hour (PriceRows, the price history),
each part rounded per rollup; `adjustment` is the total less the parts, what the split cannot show:
each request's parts were rounded on their own at settlement, a price change inside an hour, a request
admitted at prices cached just before a change. It is usually a few micro-units, and zero when the hour
is one request. A rollup from before migration 0008 (cost NULL, never recomputed; its quantities were
exported, not a cost) counts at the split, with no adjustment.

A bill is in one currency: a line per base model, adapter and currency (a rollup's), and a period whose
priced lines are in two currencies (a postpaid tenant's tier changed currency) is an InvalidPeriod naming
`end`: bill each side of the change. Lines no price covered ("xxx", cost 0) join any bill. `prices` are
the tenant's tier's current prices, for reference only.

Arithmetic (all `Decimal`, computed at 60 significant digits so nothing is rounded before the end):
- input tokens = prompt tokens - cached tokens (cached tokens are part of the prompt, as in OpenAI's usage);
- GPU seconds = gpu_ms / 1000, with each rollup's gpu_ms (a double) taken at its shortest decimal
  representation (repr), summed exactly, and rounded to 6 decimals (microseconds);
- each part = quantity x price (per million tokens, or per second), rounded ONCE per rollup to 6 decimals
  with ROUND_HALF_EVEN (banker's rounding);
- a line's total is its parts plus its adjustment, exactly, and the bill's totals are sums of the lines'
  amounts, so the lines always add up to the total exactly.
"""

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Context, Decimal, localcontext

from sqlalchemy import select
from sqlalchemy.orm import Session

from billing import repository
from billing.micros import from_micros
from billing.models import BASE_ADAPTER_KEY, STORAGE_MODEL, Adapter, PriceChange, Tenant, Tier, UsageRollup

MONEY_DECIMALS = 6
MONEY_STEP = Decimal(1).scaleb(-MONEY_DECIMALS)  # 0.000001
ROUNDING = ROUND_HALF_EVEN
ZERO = Decimal("0.000000")
NO_CURRENCY = "xxx"  # ISO 4217's code for "no currency": a rollup no price covered (billing.usage)
MILLION = Decimal(1_000_000)
# Wide enough that products of BIGINT token counts (19 digits) and prices (15 digits) are exact.
_EXACT = Context(prec=60, rounding=ROUNDING)


class InvalidPeriod(ValueError):
    """A bill's period that is not [start, end) in whole UTC hours with end > start; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Prices:
    """A tier's prices, as billed."""

    tier: str
    currency: str
    input_per_mtok: Decimal
    cached_input_per_mtok: Decimal
    output_per_mtok: Decimal
    gpu_per_second: Decimal
    storage_per_gb_day: Decimal = Decimal(0)  # a tier's (app.storage_billing); no price history has it

    def times(self, factor: Decimal) -> "Prices":
        """These prices multiplied by `factor` (a tier's batch price factor)."""
        if factor == 1:
            return self
        return replace(
            self,
            input_per_mtok=self.input_per_mtok * factor,
            cached_input_per_mtok=self.cached_input_per_mtok * factor,
            output_per_mtok=self.output_per_mtok * factor,
            gpu_per_second=self.gpu_per_second * factor,
        )


@dataclass(frozen=True)
class BillLine:
    """The usage of one adapter (or the base model itself) on one base model, and its costs."""

    base_model: str
    adapter_id: str | None  # None: the base model without an adapter
    adapter: str  # the adapter's name, or "base"
    currency: str  # its rollups' currency, as settled
    requests: int
    input_tokens: int  # prompt tokens not served from the prefix cache
    cached_input_tokens: int
    output_tokens: int
    gpu_seconds: Decimal
    input_cost: Decimal
    cached_input_cost: Decimal
    output_cost: Decimal
    gpu_cost: Decimal
    storage_cost: Decimal  # the hourly storage charges: the whole of a `storage` line, no other's
    adjustment: Decimal  # total less the parts: what settlement's own roundings and prices made of it
    total: Decimal  # what was settled and exported: its rollups' cost_micros


@dataclass(frozen=True)
class BillTotals:
    requests: int
    input_tokens: int
    cached_input_tokens: int
    output_tokens: int
    gpu_seconds: Decimal
    input_cost: Decimal
    cached_input_cost: Decimal
    output_cost: Decimal
    gpu_cost: Decimal
    storage_cost: Decimal
    adjustment: Decimal
    total: Decimal


@dataclass(frozen=True)
class Bill:
    tenant_id: str
    start: datetime
    end: datetime
    currency: str  # the lines' (the tier's current one when no line is priced)
    prices: Prices  # the tier's current prices, for reference: the lines are as settled
    lines: list[BillLine]
    totals: BillTotals


def money(amount: Decimal) -> Decimal:
    """An amount rounded to 6 decimals, half to even."""
    return amount.quantize(MONEY_STEP, rounding=ROUNDING, context=_EXACT)


def token_cost(tokens: int, price_per_mtok: Decimal) -> Decimal:
    """tokens x price per million tokens, exact, then rounded once: token_cost(1_234_567, 0.15) == 0.185185
    (0.18518505 before rounding)."""
    with localcontext(_EXACT):
        return money(Decimal(tokens) * price_per_mtok / MILLION)


def gpu_cost(gpu_seconds: Decimal, price_per_second: Decimal) -> Decimal:
    with localcontext(_EXACT):
        return money(gpu_seconds * price_per_second)


def gpu_seconds_of(gpu_ms: Decimal) -> Decimal:
    """Milliseconds (an exact decimal) as seconds with 6 decimals."""
    with localcontext(_EXACT):
        return money(gpu_ms / 1000)


def ms_decimal(gpu_ms: float) -> Decimal:
    """A stored double as the decimal it stands for: its shortest repr (0.1, not 0.10000000000000000555)."""
    return Decimal(repr(float(gpu_ms)))


def check_period(start: datetime, end: datetime) -> tuple[datetime, datetime]:
    """(start, end) in UTC, both whole hours, end after start; raises InvalidPeriod. Naive means UTC."""
    start, end = _utc(start), _utc(end)
    for param, moment in (("start", start), ("end", end)):
        if (moment.minute, moment.second, moment.microsecond) != (0, 0, 0):
            raise InvalidPeriod(param, f"{param} must be a whole UTC hour (bills are made of hourly rollups)")
    if end <= start:
        raise InvalidPeriod("end", "end must be after start")
    return start, end


def prices_of(session: Session, tenant_id: str) -> Prices:
    """The tenant's tier's current prices. Raises TenantNotFound."""
    tenant = repository.get_tenant(session, tenant_id=tenant_id)
    return tier_prices(repository.get_tier(session, name=tenant.tier))


def tier_prices(tier: Tier) -> Prices:
    """The tier's current prices, as its columns hold them."""
    return Prices(
        tier=tier.name,
        currency=tier.currency,
        input_per_mtok=Decimal(tier.price_input_per_mtok),
        cached_input_per_mtok=Decimal(tier.price_cached_input_per_mtok),
        output_per_mtok=Decimal(tier.price_output_per_mtok),
        gpu_per_second=Decimal(tier.price_gpu_per_second),
        storage_per_gb_day=Decimal(tier.price_storage_per_gb_day),
    )


def choose(
    rows: Iterable[PriceChange],
    *,
    tenant_id: str,
    tier: str,
    base_model: str,
    adapter_id: str | None,
    at: datetime,
) -> PriceChange | None:
    """The row in force: of those that apply at `at`, the most specific scope's latest."""
    applying = [
        r for r in rows
        if r.effective_from <= at
        and ((r.tier == tier and r.tenant_id is None) or r.tenant_id == tenant_id)
        and r.base_model in (None, base_model)
        and r.adapter_id in (None, adapter_id)
    ]  # fmt: skip
    if not applying:
        return None
    return max(applying, key=lambda r: (_specificity(r), r.effective_from, r.created_at))


def as_prices(row: PriceChange, tier: str) -> Prices:
    return Prices(
        tier=tier,
        currency=row.currency,
        input_per_mtok=Decimal(row.input_per_mtok),
        cached_input_per_mtok=Decimal(row.cached_input_per_mtok),
        output_per_mtok=Decimal(row.output_per_mtok),
        gpu_per_second=Decimal(row.gpu_per_second),
    )


class PriceRows:
    """Every price row, tier and tenant's tier, read once: the prices in force for many lookups."""

    def __init__(self, session: Session) -> None:
        self._rows = list(session.scalars(select(PriceChange)))
        self._tiers = {tier.name: tier for tier in session.scalars(select(Tier))}
        self._tier_of = dict(session.execute(select(Tenant.id, Tenant.tier)).tuples().all())

    def prices(self, tenant_id: str, base_model: str, adapter_id: str | None, at: datetime) -> Prices | None:
        """The prices in force for this tenant, model and adapter at `at` (the tier's columns when no row is
        in force then); None when the tenant or its tier is unknown."""
        tier = self._tier_of.get(tenant_id, "")
        chosen = choose(self._rows, tenant_id=tenant_id, tier=tier, base_model=base_model,
                        adapter_id=adapter_id, at=at)  # fmt: skip
        if chosen is not None:
            return as_prices(chosen, tier)
        if tier in self._tiers:
            return tier_prices(self._tiers[tier])
        return None


def _specificity(row: PriceChange) -> tuple[bool, bool, bool]:
    return (row.adapter_id is not None, row.base_model is not None, row.tenant_id is not None)


@dataclass
class _Sums:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    gpu_ms: Decimal = Decimal(0)
    parts: tuple[Decimal, Decimal, Decimal, Decimal] = (ZERO, ZERO, ZERO, ZERO)
    settled: Decimal = ZERO


def bill(session: Session, *, tenant_id: str, start: datetime, end: datetime) -> Bill:
    """The tenant's bill for the rolled-up hours in [start, end), at the costs settled for them.

    Raises TenantNotFound, InvalidPeriod (not whole UTC hours, end <= start, or priced lines in two
    currencies). Lines are ordered by base model, the base model's own line first, then adapters by name.
    """
    start, end = check_period(start, end)
    prices = prices_of(session, tenant_id)
    rollups = session.scalars(
        select(UsageRollup).where(
            UsageRollup.tenant_id == tenant_id, UsageRollup.hour >= start, UsageRollup.hour < end
        )
    ).all()
    currencies = sorted({r.currency for r in rollups} - {NO_CURRENCY})
    if len(currencies) > 1:
        raise InvalidPeriod(
            "end", f"the period's usage was settled in {' and '.join(currencies)}: bill each currency's hours"
        )
    history = PriceRows(session)
    sums: defaultdict[tuple[str, str, str], _Sums] = defaultdict(_Sums)
    with localcontext(_EXACT):
        for rollup in rollups:
            line = sums[(rollup.base_model, rollup.adapter_key, rollup.currency)]
            line.requests += int(rollup.requests)
            line.prompt_tokens += int(rollup.prompt_tokens)
            line.cached_tokens += int(rollup.cached_tokens)
            line.completion_tokens += int(rollup.completion_tokens)
            gpu_ms = ms_decimal(rollup.gpu_ms)
            line.gpu_ms += gpu_ms
            adapter_id = None if rollup.adapter_key == BASE_ADAPTER_KEY else rollup.adapter_key
            in_force = history.prices(tenant_id, rollup.base_model, adapter_id, rollup.hour)
            parts = _parts(rollup, gpu_ms, in_force)
            line.parts = (
                line.parts[0] + parts[0], line.parts[1] + parts[1],
                line.parts[2] + parts[2], line.parts[3] + parts[3],
            )  # fmt: skip
            line.settled += _sum(parts) if rollup.cost_micros is None else from_micros(rollup.cost_micros)
    names = adapter_names(session, {key for _, key, _ in sums if key != BASE_ADAPTER_KEY})
    lines = [_line(key, names, totals) for key, totals in sums.items()]
    lines.sort(
        key=lambda line: (line.base_model, line.adapter_id is not None, line.adapter, line.adapter_id or "",
                          line.currency)
    )  # fmt: skip
    currency = currencies[0] if currencies else prices.currency
    return Bill(tenant_id=tenant_id, start=start, end=end, currency=currency, prices=prices, lines=lines,
                totals=_totals(lines))  # fmt: skip


def _parts(rollup: UsageRollup, gpu_ms: Decimal, prices: Prices | None) -> tuple[Decimal, ...]:
    """The rollup's quantities at `prices`, each rounded once; zeros when no price covers them."""
    if prices is None or rollup.currency == NO_CURRENCY:
        return (ZERO, ZERO, ZERO, ZERO)
    return (
        token_cost(int(rollup.prompt_tokens) - int(rollup.cached_tokens), prices.input_per_mtok),
        token_cost(int(rollup.cached_tokens), prices.cached_input_per_mtok),
        token_cost(int(rollup.completion_tokens), prices.output_per_mtok),
        gpu_cost(gpu_seconds_of(gpu_ms), prices.gpu_per_second),
    )


def adapter_names(session: Session, adapter_ids: set[str]) -> dict[str, str]:
    """Adapter id -> name, for adapters deleted since too (their rows stay)."""
    if not adapter_ids:
        return {}
    rows = session.execute(select(Adapter.id, Adapter.name).where(Adapter.id.in_(sorted(adapter_ids))))
    return {adapter_id: name for adapter_id, name in rows.tuples()}


def _line(key: tuple[str, str, str], names: dict[str, str], sums: _Sums) -> BillLine:
    base_model, adapter_key, currency = key
    adapter_id = None if adapter_key == BASE_ADAPTER_KEY else adapter_key
    parts = sums.parts
    storage = _sum([sums.settled]) if base_model == STORAGE_MODEL else ZERO
    return BillLine(
        base_model=base_model,
        adapter_id=adapter_id,
        adapter=BASE_ADAPTER_KEY if adapter_id is None else names.get(adapter_id, adapter_id),
        currency=currency,
        requests=sums.requests,
        input_tokens=sums.prompt_tokens - sums.cached_tokens,
        cached_input_tokens=sums.cached_tokens,
        output_tokens=sums.completion_tokens,
        gpu_seconds=gpu_seconds_of(sums.gpu_ms),
        input_cost=parts[0],
        cached_input_cost=parts[1],
        output_cost=parts[2],
        gpu_cost=parts[3],
        storage_cost=storage,
        adjustment=_sum([sums.settled, -_sum(parts), -storage]),
        total=_sum([sums.settled]),
    )


def _totals(lines: list[BillLine]) -> BillTotals:
    return BillTotals(
        requests=sum(line.requests for line in lines),
        input_tokens=sum(line.input_tokens for line in lines),
        cached_input_tokens=sum(line.cached_input_tokens for line in lines),
        output_tokens=sum(line.output_tokens for line in lines),
        gpu_seconds=_sum(line.gpu_seconds for line in lines),
        input_cost=_sum(line.input_cost for line in lines),
        cached_input_cost=_sum(line.cached_input_cost for line in lines),
        output_cost=_sum(line.output_cost for line in lines),
        gpu_cost=_sum(line.gpu_cost for line in lines),
        storage_cost=_sum(line.storage_cost for line in lines),
        adjustment=_sum(line.adjustment for line in lines),
        total=_sum(line.total for line in lines),
    )


def _sum(amounts: Iterable[Decimal]) -> Decimal:
    """An exact sum, with 6 decimals even when empty."""
    with localcontext(_EXACT):
        return sum(amounts, ZERO)


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
