"""Request and response bodies of the budget surfaces: the admin credit and spend-limit API, and the
`budget` section of GET /v1/limits. Amounts go out as strings with 6 decimals ("12.500000")."""

from datetime import datetime
from decimal import Decimal
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.schemas.admin import DecimalString

# A decimal string or JSON number, at most 6 decimals (billing.credit.check_amount refuses the rest).
Amount = Annotated[Decimal, Field(max_digits=16, decimal_places=6, description='An amount, e.g. "25.00".')]


class CreditCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    amount: Amount
    kind: Literal["topup", "adjustment"] = Field(
        default="topup", description="topup: money paid in (> 0); adjustment: a correction of either sign."
    )
    reason: str = Field(default="", max_length=500, description="Why, for the ledger.")
    actor: str = Field(default="admin", min_length=1, max_length=128, description="Who, for the ledger.")


class CreditEntryOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    object: Literal["credit_entry"] = "credit_entry"
    amount: DecimalString
    currency: str
    kind: str
    reason: str
    actor: str = Field(description="Who, as the request said.")
    created_at: datetime
    request_id: str | None = Field(description="The request that wrote it (null: written directly).")
    surface: Literal["admin_api", "cli"] | None = Field(
        description="admin_api, or cli (the CLI through the admin API); null: written directly."
    )


class SpendLimitIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    amount: Amount
    hard: bool = Field(default=True, description="Hard: refuse past it (429). Soft: serve, and warn once.")


class BudgetsSet(BaseModel):
    """The tenant's spend limits per UTC period; null (or absent) removes that period's limit."""

    model_config = ConfigDict(extra="forbid")

    day: SpendLimitIn | None = None
    month: SpendLimitIn | None = None


class SpendLimitOut(BaseModel):
    amount: DecimalString
    hard: bool
    spent: DecimalString = Field(description="Settled spend in the current period.")
    remaining: DecimalString = Field(description="amount - spent - reserved (never below 0).")


class BudgetOut(BaseModel):
    """A tenant's money now: balance (prepaid only), spend this UTC day and month, reserved by requests in
    flight, and the limits."""

    object: Literal["budget"] = "budget"
    currency: str
    prepaid: bool
    balance: DecimalString | None = Field(description="Prepaid credit left; null when not prepaid.")
    reserved: DecimalString = Field(description="Held by requests in flight (their worst case).")
    spent_today: DecimalString
    spent_this_month: DecimalString
    remaining: DecimalString | None = Field(
        description="What one more request may still reserve; null: no cap."
    )
    limits: dict[str, SpendLimitOut] = Field(description="By period: day, month.")
    soft_limit_events: list[str] = Field(
        default_factory=list, description="Soft limits passed this period, each noted once."
    )
    entries: list[CreditEntryOut] | None = Field(default=None, description="The credit ledger (admin view).")
