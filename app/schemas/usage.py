"""Usage API answers: live usage rows (billing.usage_queries) and bills (billing.pricing).

Money, prices and GPU seconds are decimal strings with 6 decimals ("0.185185"), never JSON numbers, so no
client reads them as floats. Token counts are integers; live usage's gpu_ms is a number (not money).
"""

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from app.schemas.admin import DecimalString
from billing.usage_queries import GroupBy


class UsageRowOut(BaseModel):
    """One group of requests; the fields outside the grouping are null."""

    model_config = ConfigDict(from_attributes=True)

    object: Literal["usage.bucket"] = "usage.bucket"
    tenant_id: str
    hour: datetime | None = Field(description="Grouped by hour: the UTC hour the requests started in.")
    base_model: str | None = Field(description="Grouped by model or adapter: the base model.")
    adapter_id: str | None = Field(description="Grouped by adapter: its id; null for the base model itself.")
    adapter: str | None = Field(description='Grouped by adapter: its name, or "base" for no adapter.')
    requests: int
    prompt_tokens: int = Field(description="Prompt tokens, cached ones included.")
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")
    completion_tokens: int
    gpu_ms: float = Field(description="Engine GPU time, in milliseconds.")


class UsageList(BaseModel):
    object: Literal["list"] = "list"
    start: datetime
    end: datetime
    group_by: GroupBy
    data: list[UsageRowOut]


class PricesOut(BaseModel):
    """The tier's prices the bill was computed with (its current ones)."""

    model_config = ConfigDict(from_attributes=True)

    tier: str
    currency: str
    input_per_mtok: DecimalString
    cached_input_per_mtok: DecimalString
    output_per_mtok: DecimalString
    gpu_per_second: DecimalString


class BillLineOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    base_model: str
    adapter_id: str | None = Field(description="null: the base model without an adapter.")
    adapter: str = Field(description='The adapter\'s name, or "base".')
    requests: int
    input_tokens: int = Field(description="Prompt tokens minus cached ones.")
    cached_input_tokens: int
    output_tokens: int
    gpu_seconds: DecimalString
    input_cost: DecimalString
    cached_input_cost: DecimalString
    output_cost: DecimalString
    gpu_cost: DecimalString
    total: DecimalString


class BillTotalsOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    requests: int
    input_tokens: int
    cached_input_tokens: int
    output_tokens: int
    gpu_seconds: DecimalString
    input_cost: DecimalString
    cached_input_cost: DecimalString
    output_cost: DecimalString
    gpu_cost: DecimalString
    total: DecimalString


class BillOut(BaseModel):
    """A tenant's bill for the rolled-up hours in [start, end), at its tier's current prices. Each cost is
    rounded once to 6 decimals (half to even); totals are sums of the lines."""

    model_config = ConfigDict(from_attributes=True)

    object: Literal["bill"] = "bill"
    tenant_id: str
    start: datetime
    end: datetime
    currency: str
    prices: PricesOut
    lines: list[BillLineOut]
    totals: BillTotalsOut
