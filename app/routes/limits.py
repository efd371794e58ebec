"""GET /v1/limits: the calling tenant's rate limits and its headroom in the current window, and its money
(balance, spend this period, reserved now, spend limits) when it is prepaid or spend-limited.

Headroom is read with the limiter backend's `peek`, which admits, reserves and renews nothing: reading it
as often as you like never costs a request or a token. Reads go through a PeekCache, so the figures may be
up to a second old and a loop of reads cannot load the limiter every admission needs. The response
carries the same x-ratelimit-* headers an admitted request gets, so clients can read either.
"""

from decimal import Decimal
from typing import Literal

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field

from app.budgets.view import budget_out
from app.deps import ReaderDep, ServicesDep
from app.errors import BudgetUnavailable
from app.limits import WINDOW_MS, Decision, LimiterUnavailable, Limits, WindowState
from app.limits.peek_cache import PeekCache
from app.route_guards import TenantRoute
from app.schemas.budgets import BudgetOut

router = APIRouter(prefix="/v1", tags=["limits"], route_class=TenantRoute)


class TierLimitsOut(BaseModel):
    """The tier's limits with the tenant's overrides applied; null means unlimited."""

    rpm: int | None = Field(description="Requests per minute.")
    tpm: int | None = Field(description="Tokens per minute (prompt + max_tokens, then what was used).")
    max_concurrent: int | None = Field(
        description="Sequences in flight at once: each request counts its n x prompts choices."
    )
    max_tokens_cap: int | None = Field(description="The largest max_tokens a request may ask for.")
    on_limit: Literal["reject", "queue"] = Field(description="Over a limit: 429 at once, or wait in a queue.")
    max_queue_ms: int = Field(description="How long a queued request may wait before its 429.")


class HeadroomOut(BaseModel):
    """What is left in the current one-minute window; `remaining_*` are null for unlimited dimensions."""

    requests: int = Field(description="Requests admitted in the last minute.")
    remaining_requests: int | None
    reset_requests_ms: int = Field(description="Until the request window is empty again.")
    tokens: int = Field(description="Tokens counted in the last minute.")
    remaining_tokens: int | None
    reset_tokens_ms: int = Field(description="Until the token window is empty again.")
    in_flight: int = Field(description="Sequences running now (each request counts its n x prompts).")
    remaining_concurrent: int | None
    queued: int = Field(description="Requests waiting in the queue.")


class RateLimitsOut(BaseModel):
    object: Literal["rate_limits"] = "rate_limits"
    tier: str
    window_ms: int = Field(description="Length of the sliding window the rpm and tpm limits apply to.")
    limits: TierLimitsOut
    headroom: HeadroomOut | None = Field(
        description="null when the tier has no limit at all: admission then counts nothing to report."
    )
    budget: BudgetOut | None = Field(
        default=None,
        description="Money: balance, spend this period, reserved now, spend limits; null: neither prepaid "
        "nor spend-limited.",
    )


def _headroom(state: WindowState, limits: Limits) -> HeadroomOut:
    concurrent = None if limits.max_concurrent is None else max(0, limits.max_concurrent - state.in_flight)
    return HeadroomOut(
        requests=state.requests,
        remaining_requests=state.remaining_requests(limits),
        reset_requests_ms=state.reset_requests_ms,
        tokens=state.tokens,
        remaining_tokens=state.remaining_tokens(limits),
        reset_tokens_ms=state.reset_tokens_ms,
        in_flight=state.in_flight,
        remaining_concurrent=concurrent,
        queued=state.queued,
    )


def _headers(state: WindowState, limits: Limits) -> dict[str, str]:
    # A Decision only to reuse its header rendering, so both endpoints format them identically.
    decision = Decision(
        admitted=True,
        reason=None,
        retry_after_ms=0,
        limit_requests=limits.rpm,
        remaining_requests=state.remaining_requests(limits),
        reset_requests_ms=state.reset_requests_ms,
        limit_tokens=limits.tpm,
        remaining_tokens=state.remaining_tokens(limits),
        reset_tokens_ms=state.reset_tokens_ms,
    )
    return decision.headers()


@router.get("/limits")
async def rate_limits(
    principal: ReaderDep, services: ServicesDep, request: Request, response: Response
) -> RateLimitsOut:
    """The calling tenant's limits and current headroom (at most a second old); reading them consumes
    nothing."""
    limits = principal.limits
    headroom = None
    if not limits.unlimited:
        state = request.app.state
        state.limits_peeks = peeks = PeekCache.reuse(getattr(state, "limits_peeks", None), services.limiter)
        # LimiterUnavailable becomes a 503: unlike admission, fail-open has nothing to let through here.
        window = await peeks.peek(principal.tenant_id)
        headroom = _headroom(window, limits)
        response.headers.update(_headers(window, limits))
    budget = None
    guard = services.budget_guard
    if principal.budgeted and guard is not None:
        try:
            budget = await budget_out(guard, principal.tenant_id, with_entries=False)
        except LimiterUnavailable:
            raise BudgetUnavailable() from None
        if budget.remaining is not None:
            response.headers["x-budget-remaining"] = format(
                budget.remaining.quantize(Decimal("0.000001")), "f"
            )
            response.headers["x-budget-currency"] = budget.currency
    return RateLimitsOut(
        budget=budget,
        tier=principal.tier,
        window_ms=WINDOW_MS,
        limits=TierLimitsOut(
            rpm=limits.rpm,
            tpm=limits.tpm,
            max_concurrent=limits.max_concurrent,
            max_tokens_cap=limits.max_tokens_cap,
            on_limit=limits.on_limit,
            max_queue_ms=limits.max_queue_ms,
        ),
        headroom=headroom,
    )
