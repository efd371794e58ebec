"""Admin API bodies: tenants, tiers and API keys."""

from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer

from app.limits import Limits
from billing.models import Tenant
from billing.repository import (
    LIMIT_MAX,
    MAX_QUEUE_MS,
    MAX_WEIGHT,
    PRICE_DECIMALS,
    PRICE_MAX_DIGITS,
    PRICE_STEP,
)

# Limits: positive integers, JSON integers only (no "5", 5.0 or true); null means unlimited.
Rpm = Annotated[int, Field(strict=True, ge=1, le=LIMIT_MAX["rpm"], description="Requests per minute.")]
Tpm = Annotated[
    int, Field(strict=True, ge=1, le=LIMIT_MAX["tpm"], description="Tokens (prompt + completion) per minute.")
]
MaxConcurrent = Annotated[
    int,
    Field(
        strict=True,
        ge=1,
        le=LIMIT_MAX["max_concurrent"],
        description="Sequences in flight at once (n x prompts per request).",
    ),
]
MaxTokensCap = Annotated[
    int,
    Field(
        strict=True, ge=1, le=LIMIT_MAX["max_tokens_cap"], description="Largest max_tokens of one request."
    ),
]
OnLimit = Literal["reject", "queue"]
StoredBytes = Annotated[
    int,
    Field(
        strict=True,
        ge=1,
        le=LIMIT_MAX["max_stored_response_bytes"],
        description=(
            "The most each of the tier's tenants may keep in stored responses (store: true), in bytes of "
            "stored JSON over its live responses; past it, storing is refused (403 storage_quota_exceeded) "
            "and store: false still works. Null: no bound."
        ),
    ),
]
Weight = Annotated[
    float,
    Field(
        strict=True,
        gt=0,
        le=MAX_WEIGHT,
        allow_inf_nan=False,
        description=(
            "The tier's tenants' share of an engine replica while requests wait, against other tenants': "
            "a tenant of weight 2 is served about twice what a tenant of weight 1 is. Default 1."
        ),
    ),
]
QueueMs = Annotated[
    int,
    Field(
        strict=True,
        ge=0,
        le=MAX_QUEUE_MS,
        description="How long a request may wait when on_limit is queue (then > 0).",
    ),
]
TierName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="Unique tier name: letters, digits, '.', '_' and '-' (it appears in URLs).",
    ),
]

# Prices: a decimal string ("0.15") or a JSON number, non-negative, at most 6 decimals and 15 digits;
# answered as a string with all 6 decimals ("0.150000"), which no JSON parser turns into a float.
_PRICE = {"ge": 0, "max_digits": PRICE_MAX_DIGITS, "decimal_places": PRICE_DECIMALS}
PriceInput = Annotated[
    Decimal, Field(**_PRICE, description="Price in the tier's currency per million input tokens.")
]
PriceCachedInput = Annotated[
    Decimal, Field(**_PRICE, description="Price per million cached input tokens (prompt prefix hits).")
]
PriceOutput = Annotated[Decimal, Field(**_PRICE, description="Price per million output tokens.")]
PriceGpuSecond = Annotated[Decimal, Field(**_PRICE, description="Price per GPU-second of engine time.")]
PriceStorage = Annotated[
    Decimal,
    Field(
        **_PRICE,
        description="Price per GB (10^9 bytes) a day of stored responses and files, charged hourly.",
    ),
]
BatchPriceFactor = Annotated[
    Decimal,
    Field(
        ge=0,
        le=1,
        max_digits=5,
        decimal_places=4,
        description="A Batch API line's cost is its price times this, 0 to 1 (default 0.5: half price).",
    ),
]
Currency = Annotated[
    str, Field(pattern=r"^[A-Za-z]{3}$", description="ISO 4217 code, stored lowercase (e.g. usd).")
]


def decimal_string(value: Decimal) -> str:
    """A price or amount as a fixed-point string with 6 decimals: Decimal("0.15") -> "0.150000"."""
    return format(value.quantize(PRICE_STEP), "f")


DecimalString = Annotated[Decimal, PlainSerializer(decimal_string, return_type=str)]
FactorString = Annotated[
    Decimal,
    PlainSerializer(lambda value: format(Decimal(value).quantize(Decimal("0.0001")), "f"), return_type=str),
]
StripeCustomer = Annotated[
    str,
    Field(
        pattern=r"^cus_[A-Za-z0-9]{1,60}$",
        description="The Stripe customer the tenant's usage is billed to (cus_...).",
    ),
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def changes(self) -> dict[str, Any]:
        """The fields the request gave, with their values (null included): what a PATCH changes."""
        return {name: getattr(self, name) for name in self.model_fields_set}


class LimitsOut(BaseModel):
    """Limits in force; null: unlimited."""

    model_config = ConfigDict(from_attributes=True)

    rpm: int | None
    tpm: int | None
    max_concurrent: int | None
    max_tokens_cap: int | None
    on_limit: OnLimit
    max_queue_ms: int


# Tiers


class TierCreate(_Body):
    name: TierName
    description: str = Field(default="", max_length=1000)
    rpm: Rpm | None = None
    tpm: Tpm | None = None
    max_concurrent: MaxConcurrent | None = None
    max_tokens_cap: MaxTokensCap | None = None
    on_limit: OnLimit = Field(default="reject", description="Over a limit: 429 at once, or wait first.")
    max_queue_ms: QueueMs = 0
    price_input_per_mtok: PriceInput = Decimal(0)
    price_cached_input_per_mtok: PriceCachedInput = Decimal(0)
    price_output_per_mtok: PriceOutput = Decimal(0)
    price_gpu_per_second: PriceGpuSecond = Decimal(0)
    currency: Currency = "usd"
    weight: Weight = 1.0
    max_stored_response_bytes: StoredBytes | None = None
    batch_price_factor: BatchPriceFactor = Decimal("0.5")
    price_storage_per_gb_day: PriceStorage = Decimal(0)


class TierUpdate(_Body):
    """Only the fields given change; a limit given as null becomes unlimited. Prices cannot be null."""

    description: str = Field(default="", max_length=1000)
    rpm: Rpm | None = None
    tpm: Tpm | None = None
    max_concurrent: MaxConcurrent | None = None
    max_tokens_cap: MaxTokensCap | None = None
    on_limit: OnLimit = "reject"
    max_queue_ms: QueueMs = 0
    price_input_per_mtok: PriceInput = Decimal(0)
    price_cached_input_per_mtok: PriceCachedInput = Decimal(0)
    price_output_per_mtok: PriceOutput = Decimal(0)
    price_gpu_per_second: PriceGpuSecond = Decimal(0)
    currency: Currency = "usd"
    weight: Weight = 1.0
    max_stored_response_bytes: StoredBytes | None = None
    batch_price_factor: BatchPriceFactor = Decimal("0.5")
    price_storage_per_gb_day: PriceStorage = Decimal(0)


class TierOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    name: str
    object: Literal["tier"] = "tier"
    description: str
    rpm: int | None
    tpm: int | None
    max_concurrent: int | None
    max_tokens_cap: int | None
    on_limit: OnLimit
    max_queue_ms: int
    price_input_per_mtok: DecimalString = Field(description='Per million input tokens, e.g. "0.150000".')
    price_cached_input_per_mtok: DecimalString = Field(description="Per million cached input tokens.")
    price_output_per_mtok: DecimalString = Field(description="Per million output tokens.")
    price_gpu_per_second: DecimalString = Field(description="Per GPU-second.")
    currency: str
    weight: float = Field(description="The tier's share of an engine replica while requests wait.")
    max_stored_response_bytes: int | None = Field(
        description="Each tenant's quota of stored responses, in bytes; null: no bound."
    )
    batch_price_factor: FactorString = Field(
        description='A Batch API line\'s cost is its price times this, e.g. "0.5000".'
    )
    price_storage_per_gb_day: DecimalString = Field(
        description="Per GB (10^9 bytes) a day of stored responses and files, charged hourly."
    )
    created_at: datetime


class TierList(BaseModel):
    object: Literal["list"] = "list"
    data: list[TierOut]


# Tenants


class TenantCreate(_Body):
    name: str = Field(min_length=1, max_length=128, description="Unique tenant name.")
    tier: str = Field(default="free", min_length=1, max_length=64, description="Pricing tier.")


class TenantUpdate(_Body):
    """name and tier: null or absent leaves them. Limit overrides: only those given change; null clears one
    (the tier's value applies again). stripe_customer_id: absent leaves it, null clears it."""

    name: str | None = Field(default=None, min_length=1, max_length=128)
    tier: str | None = Field(default=None, min_length=1, max_length=64)
    stripe_customer_id: StripeCustomer | None = None
    rpm: Rpm | None = None
    tpm: Tpm | None = None
    max_concurrent: MaxConcurrent | None = None
    max_tokens_cap: MaxTokensCap | None = None


class TenantOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    object: Literal["tenant"] = "tenant"
    name: str
    tier: str
    status: str
    created_at: datetime
    updated_at: datetime
    disabled_at: datetime | None
    rpm: int | None = Field(description="The tenant's own rpm over its tier's; null: the tier's applies.")
    tpm: int | None = Field(description="Override of the tier's tpm; null: none.")
    max_concurrent: int | None = Field(description="Override of the tier's max_concurrent; null: none.")
    max_tokens_cap: int | None = Field(description="Override of the tier's max_tokens_cap; null: none.")
    stripe_customer_id: str | None = Field(description="The Stripe customer billed (cus_...); null: none.")
    limits: LimitsOut = Field(description="What applies: the tier's limits with the overrides.")

    @classmethod
    def of(cls, tenant: Tenant, limits: Limits) -> Self:
        """From the tenant's row and its effective limits (app.auth.authenticator.limits_for)."""
        fields = {
            name: getattr(tenant, name) for name in cls.model_fields if name not in ("object", "limits")
        }
        return cls(**fields, limits=LimitsOut.model_validate(limits))


class TenantList(BaseModel):
    object: Literal["list"] = "list"
    data: list[TenantOut]


class KeyCreate(_Body):
    name: str | None = Field(default=None, max_length=128, description="A label for the key.")
    expires_at: datetime | None = Field(default=None, description="When the key stops working (UTC).")
    expires_in_days: int | None = Field(default=None, ge=1, le=3650, description="Alternative to expires_at.")


class KeyOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    object: Literal["api_key"] = "api_key"
    tenant_id: str
    name: str | None
    prefix: str = Field(description="Public part of the key, shown in listings.")
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None


class KeyCreated(KeyOut):
    key: str = Field(description="The secret key. Shown once; store it now.")


class KeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[KeyOut]
