"""Bills: a tenant's usage over a period, priced at its tier's prices, in exact decimal arithmetic.

A bill is computed from the hourly rollups (billing.usage), not from the raw events: rollups are what the
Stripe exporter meters, and an hour's rollup stops changing once the hour is closed
(billing.usage.closed_before) and rolled up. So a bill over closed, rolled-up hours is reproducible from
the database alone: the same period gives the same bill tomorrow (unless the tier's prices change, see
below). Hours not yet rolled up are simply absent; the live view is billing.usage_queries.

The period is [start, end) in whole UTC hours: the rollups whose hour starts at or after `start` and
before `end`. Prices are the tenant's tier's CURRENT prices: there is no price history, so changing a
tier's prices reprices every bill computed afterwards, past periods included.

Arithmetic (all `Decimal`, computed at 60 significant digits so nothing is rounded before the end):
- input tokens = prompt tokens - cached tokens (cached tokens are part of the prompt, as in OpenAI's usage);
- GPU seconds = gpu_ms / 1000, with each rollup's gpu_ms (a double) taken at its shortest decimal
  representation (repr), summed exactly, and rounded to 6 decimals (microseconds);
- each cost = quantity x price (per million tokens, or per second), rounded ONCE to 6 decimals with
  ROUND_HALF_EVEN (banker's rounding);
- a line's total is the sum of its rounded costs, and the bill's totals are sums of the lines' rounded
  amounts, so the lines always add up to the total exactly.
"""

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Context, Decimal, localcontext

from sqlalchemy import select
from sqlalchemy.orm import Session

from billing import repository
from billing.models import BASE_ADAPTER_KEY, Adapter, Tier, UsageRollup

MONEY_DECIMALS = 6
MONEY_STEP = Decimal(1).scaleb(-MONEY_DECIMALS)  # 0.000001
ROUNDING = ROUND_HALF_EVEN
ZERO = Decimal("0.000000")
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


@dataclass(frozen=True)
class BillLine:
    """The usage of one adapter (or the base model itself) on one base model, and its costs."""

    base_model: str
    adapter_id: str | None  # None: the base model without an adapter
    adapter: str  # the adapter's name, or "base"
    requests: int
    input_tokens: int  # prompt tokens not served from the prefix cache
    cached_input_tokens: int
    output_tokens: int
    gpu_seconds: Decimal
    input_cost: Decimal
    cached_input_cost: Decimal
    output_cost: Decimal
    gpu_cost: Decimal
    total: Decimal


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
    total: Decimal


@dataclass(frozen=True)
class Bill:
    tenant_id: str
    start: datetime
    end: datetime
    prices: Prices
    lines: list[BillLine]
    totals: BillTotals

    @property
    def currency(self) -> str:
        return self.prices.currency


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
    )


@dataclass
class _Sums:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    gpu_ms: Decimal = Decimal(0)


def bill(session: Session, *, tenant_id: str, start: datetime, end: datetime) -> Bill:
    """The tenant's bill for the rolled-up hours in [start, end) at its tier's current prices.

    Raises TenantNotFound, InvalidPeriod (not whole UTC hours, or end <= start). Lines are ordered by base
    model, the base model's own line first, then adapters by name.
    """
    start, end = check_period(start, end)
    prices = prices_of(session, tenant_id)
    rollups = session.scalars(
        select(UsageRollup).where(
            UsageRollup.tenant_id == tenant_id, UsageRollup.hour >= start, UsageRollup.hour < end
        )
    ).all()
    sums: defaultdict[tuple[str, str], _Sums] = defaultdict(_Sums)
    with localcontext(_EXACT):
        for rollup in rollups:
            line = sums[(rollup.base_model, rollup.adapter_key)]
            line.requests += int(rollup.requests)
            line.prompt_tokens += int(rollup.prompt_tokens)
            line.cached_tokens += int(rollup.cached_tokens)
            line.completion_tokens += int(rollup.completion_tokens)
            line.gpu_ms += ms_decimal(rollup.gpu_ms)
    names = adapter_names(session, {key for _, key in sums if key != BASE_ADAPTER_KEY})
    lines = [_line(base_model, key, names, totals, prices) for (base_model, key), totals in sums.items()]
    lines.sort(
        key=lambda line: (line.base_model, line.adapter_id is not None, line.adapter, line.adapter_id or "")
    )
    return Bill(tenant_id=tenant_id, start=start, end=end, prices=prices, lines=lines, totals=_totals(lines))


def adapter_names(session: Session, adapter_ids: set[str]) -> dict[str, str]:
    """Adapter id -> name, for adapters deleted since too (their rows stay)."""
    if not adapter_ids:
        return {}
    rows = session.execute(select(Adapter.id, Adapter.name).where(Adapter.id.in_(sorted(adapter_ids))))
    return {adapter_id: name for adapter_id, name in rows.tuples()}


def _line(base_model: str, key: str, names: dict[str, str], sums: _Sums, prices: Prices) -> BillLine:
    adapter_id = None if key == BASE_ADAPTER_KEY else key
    input_tokens = sums.prompt_tokens - sums.cached_tokens
    seconds = gpu_seconds_of(sums.gpu_ms)
    costs = (
        token_cost(input_tokens, prices.input_per_mtok),
        token_cost(sums.cached_tokens, prices.cached_input_per_mtok),
        token_cost(sums.completion_tokens, prices.output_per_mtok),
        gpu_cost(seconds, prices.gpu_per_second),
    )
    return BillLine(
        base_model=base_model,
        adapter_id=adapter_id,
        adapter=BASE_ADAPTER_KEY if adapter_id is None else names.get(adapter_id, adapter_id),
        requests=sums.requests,
        input_tokens=input_tokens,
        cached_input_tokens=sums.cached_tokens,
        output_tokens=sums.completion_tokens,
        gpu_seconds=seconds,
        input_cost=costs[0],
        cached_input_cost=costs[1],
        output_cost=costs[2],
        gpu_cost=costs[3],
        total=_sum(costs),
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
        total=_sum(line.total for line in lines),
    )


def _sum(amounts: Iterable[Decimal]) -> Decimal:
    """An exact sum, with 6 decimals even when empty."""
    with localcontext(_EXACT):
        return sum(amounts, ZERO)


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
