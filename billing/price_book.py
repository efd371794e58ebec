"""The price book: which prices were in force for a request, and what a request costs at them.

Prices are effective-dated rows (billing.models.PriceChange) in scopes, from the broadest to the most
specific: the tenant's tier, the tenant itself, and either narrowed to a base model or an adapter (a
premium adapter). At a moment, the most specific scope that has a row in force wins, and within it the
latest row. A price change is a new row: what a past request cost (usage_events.cost, fixed when it was
settled) never changes.

Costs use billing.pricing's arithmetic: each part (input, cached input, output, GPU time) rounded once to
6 decimals, half to even, then summed.
"""

from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_CEILING, Context, Decimal, localcontext

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from billing import repository
from billing.models import PriceChange, UsageEvent, utcnow
from billing.pricing import (
    MILLION,
    MONEY_STEP,
    ZERO,
    PriceRows,
    Prices,
    as_prices,
    choose,
    gpu_cost,
    gpu_seconds_of,
    ms_decimal,
    tier_prices,
    token_cost,
)


@dataclass(frozen=True)
class Metered:
    """What a request used, as the engine reported it."""

    prompt_tokens: int
    cached_tokens: int  # part of prompt_tokens
    completion_tokens: int
    gpu_ms: float = 0.0


def set_prices(
    session: Session,
    *,
    tenant_id: str,
    prices: Prices,
    base_model: str | None = None,
    adapter_id: str | None = None,
    effective_from: datetime | None = None,
) -> PriceChange:
    """Prices for one tenant (optionally only for one base model or adapter), from `effective_from`."""
    repository.get_tenant(session, tenant_id=tenant_id)
    row = PriceChange(
        tenant_id=tenant_id,
        base_model=base_model,
        adapter_id=adapter_id,
        effective_from=effective_from or utcnow(),
        input_per_mtok=prices.input_per_mtok,
        cached_input_per_mtok=prices.cached_input_per_mtok,
        output_per_mtok=prices.output_per_mtok,
        gpu_per_second=prices.gpu_per_second,
        currency=prices.currency,
    )
    session.add(row)
    session.flush()
    return row


def prices_at(
    session: Session, *, tenant_id: str, base_model: str, adapter_id: str | None, at: datetime | None = None
) -> Prices:
    """The prices in force for this tenant, model and adapter at `at` (default now). Raises
    TenantNotFound. A tier with no history row yet (made by hand in the database) bills its columns."""
    at = at or utcnow()
    tenant = repository.get_tenant(session, tenant_id=tenant_id)
    rows = session.scalars(
        select(PriceChange).where(
            PriceChange.effective_from <= at,
            or_(
                (PriceChange.tier == tenant.tier) & PriceChange.tenant_id.is_(None),
                PriceChange.tenant_id == tenant_id,
            ),
            or_(PriceChange.base_model.is_(None), PriceChange.base_model == base_model),
            or_(PriceChange.adapter_id.is_(None), PriceChange.adapter_id == adapter_id),
        )
    ).all()
    best = choose(rows, tenant_id=tenant_id, tier=tenant.tier, base_model=base_model, adapter_id=adapter_id,
                  at=at)  # fmt: skip
    if best is None:
        return tier_prices(repository.get_tier(session, name=tenant.tier))
    return as_prices(best, tenant.tier)


class PriceHistory(PriceRows):
    """Every price row, tier and tenant's tier, read once: what many usage rows cost at the prices in force
    when each started (reconciliation, and the rollups' cost for rows settled without one)."""

    def cost(self, event: UsageEvent) -> Decimal | None:
        """The row's usage at the prices in force when it started; None when no price covers it."""
        priced = self.priced(event)
        return None if priced is None else priced[0]

    def priced(self, event: UsageEvent) -> tuple[Decimal, str] | None:
        """The row's cost at the prices in force when it started, and their currency; None when no price
        covers it."""
        prices = self.prices(event.tenant_id, event.base_model, event.adapter_id, event.started_at)
        if prices is None:
            return None
        used = Metered(event.prompt_tokens, event.cached_tokens, event.completion_tokens, event.gpu_ms)
        return cost_of(used, prices), prices.currency


def cost_of(used: Metered, prices: Prices) -> Decimal:
    """What `used` costs at `prices`, in the prices' currency, rounded per part as bills are."""
    parts = (
        token_cost(used.prompt_tokens - used.cached_tokens, prices.input_per_mtok),
        token_cost(used.cached_tokens, prices.cached_input_per_mtok),
        token_cost(used.completion_tokens, prices.output_per_mtok),
        gpu_cost(gpu_seconds_of(ms_decimal(used.gpu_ms)), prices.gpu_per_second),
    )
    return sum(parts, ZERO)


def worst_case(
    prompt_tokens: int, output_tokens: int, prices: Prices, max_gpu_ms: float | None = None
) -> Decimal:
    """An upper bound of what a request with these prompt tokens, at most `output_tokens` output and at most
    `max_gpu_ms` of GPU time (None: GPU time is not bounded, nor counted) can cost: every prompt token at the
    dearer of the input prices (the cache may or may not hit), rounded up, plus 2 micro-units for cost_of's
    three half-even roundings of the token parts (each at most half a micro-unit up), plus the bound's GPU
    part as cost_of computes it. cost_of is monotonic in each count and in the GPU time, so no metered usage
    within these bounds costs more."""
    dearest = max(prices.input_per_mtok, prices.cached_input_per_mtok)
    with localcontext(Context(prec=60)):
        exact = (Decimal(prompt_tokens) * dearest + Decimal(output_tokens) * prices.output_per_mtok) / MILLION
        tokens = exact.quantize(MONEY_STEP, rounding=ROUND_CEILING) + 2 * MONEY_STEP
    if max_gpu_ms is None:
        return tokens
    return tokens + gpu_cost(gpu_seconds_of(ms_decimal(max_gpu_ms)), prices.gpu_per_second)
