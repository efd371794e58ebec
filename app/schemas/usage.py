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
    batch_id: str | None = Field(
        default=None, description="Grouped by batch: the Batch API batch's id; null for interactive requests."
    )
    requests: int
    prompt_tokens: int = Field(description="Prompt tokens, cached ones included.")
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")
    completion_tokens: int
    gpu_ms: float = Field(description="Engine GPU time, in milliseconds.")


class StorageOut(BaseModel):
    """What the tenant keeps stored now, against its tier's quota (issue 35; files too, issue 37)."""

    object: Literal["usage.storage"] = "usage.storage"
    stored_response_bytes: int = Field(
        description="Bytes of the tenant's live stored responses (their size_bytes, each item counted once), "
        "what its tier's quota is read against; now, not within the period."
    )
    file_bytes: int = Field(
        default=0,
        description="Bytes of the tenant's live files (the Files API), counted with its stored responses "
        "against the same quota.",
    )
    max_stored_response_bytes: int | None = Field(
        description="The tier's quota of stored bytes (stored responses and files together); null: no bound."
    )


class UsageList(BaseModel):
    object: Literal["list"] = "list"
    start: datetime
    end: datetime
    group_by: GroupBy
    data: list[UsageRowOut]
    storage: StorageOut | None = Field(
        default=None, description="GET /v1/usage: the calling tenant's storage now; null on /admin/usage."
    )


class PricesOut(BaseModel):
    """The tier's current prices, for reference: a bill's lines are at the costs settled for them."""

    model_config = ConfigDict(from_attributes=True)

    tier: str
    currency: str
    input_per_mtok: DecimalString
    cached_input_per_mtok: DecimalString
    output_per_mtok: DecimalString
    gpu_per_second: DecimalString
    storage_per_gb_day: DecimalString = Field(
        description="Per GB (10^9 bytes) of stored responses and files a day, charged hourly (base model "
        "`storage`)."
    )


class BillLineOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    base_model: str
    adapter_id: str | None = Field(description="null: the base model without an adapter.")
    adapter: str = Field(description='The adapter\'s name, or "base".')
    currency: str = Field(description='The currency its usage was settled in ("xxx": no price covered it).')
    requests: int
    input_tokens: int = Field(description="Prompt tokens minus cached ones.")
    cached_input_tokens: int
    output_tokens: int
    gpu_seconds: DecimalString
    input_cost: DecimalString
    cached_input_cost: DecimalString
    output_cost: DecimalString
    gpu_cost: DecimalString
    storage_cost: DecimalString = Field(
        description="The hourly storage charges: the whole total of the `storage` line, 0 on every other."
    )
    adjustment: DecimalString = Field(
        description="The total less the five parts: the parts split the settled total at the prices in force "
        "at each hour's start; each request was rounded, and priced, on its own when it settled."
    )
    total: DecimalString = Field(description="What was settled for it, and exported to Stripe's cost meter.")


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
    storage_cost: DecimalString
    adjustment: DecimalString
    total: DecimalString


class BillOut(BaseModel):
    """A tenant's bill for the rolled-up hours in [start, end), at the costs settled for them (a price
    change never reprices it; it equals what Stripe's cost meter was sent). Amounts have 6 decimals; each
    line's total is its parts plus its adjustment, and totals are sums of the lines. `prices` are the
    tier's current prices, for reference."""

    model_config = ConfigDict(from_attributes=True)

    object: Literal["bill"] = "bill"
    tenant_id: str
    start: datetime
    end: datetime
    currency: str
    prices: PricesOut
    lines: list[BillLineOut]
    totals: BillTotalsOut
