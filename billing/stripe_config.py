"""StripeConfig: the Stripe Billing Meters export's settings, from LORAPLEX_STRIPE_* environment variables.

Built by the caller (the metering deployment, the CLI), never at import time. An empty api_key disables the
export: nothing is planned or sent.
"""

from typing import Final

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Stripe caps meter event identifiers at 100 characters; ours are "<rollup id>-<meter key>-r<revision>",
# so an event name plays no part in their length. Event names themselves are capped by Stripe at 100.
_EVENT_NAME_PATTERN: Final = r"^[A-Za-z0-9_.:-]{1,100}$"


class StripeConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LORAPLEX_STRIPE_", extra="ignore")

    api_key: SecretStr = Field(
        default=SecretStr(""), description="Stripe secret key (sk_... or rk_...); empty disables the export."
    )
    api_base: str | None = Field(
        default=None,
        description="Base URL of Stripe's API; None: Stripe's own (https://api.stripe.com).",
    )
    meter_input_tokens: str = Field(
        default="loraplex_input_tokens",
        pattern=_EVENT_NAME_PATTERN,
        description="event_name of the meter summing uncached input tokens (prompt minus cached).",
    )
    meter_cached_input_tokens: str = Field(
        default="loraplex_cached_input_tokens",
        pattern=_EVENT_NAME_PATTERN,
        description="event_name of the meter summing cached input tokens.",
    )
    meter_output_tokens: str = Field(
        default="loraplex_output_tokens",
        pattern=_EVENT_NAME_PATTERN,
        description="event_name of the meter summing output (completion) tokens.",
    )
    meter_gpu_ms: str = Field(
        default="loraplex_gpu_ms",
        pattern=_EVENT_NAME_PATTERN,
        description="event_name of the meter summing GPU milliseconds (each hour's total, rounded).",
    )
    meter_cost: str = Field(
        default="loraplex_cost_micros",
        pattern=_EVENT_NAME_PATTERN,
        description="event_name of the monetary meter: each hour's settled cost (our prices: per tenant, "
        "adapter and base model, as in force when each request ran) in micro-units of the tenant's currency; "
        "price it at 0.000001 of the currency a unit.",
    )
    max_network_retries: int = Field(
        default=3,
        ge=0,
        le=10,
        description="Retries the Stripe SDK makes itself (connection errors, 409, 5xx) before the exporter's "
        "own backoff takes over.",
    )
    batch_limit: int = Field(
        default=1000,
        ge=1,
        description="Most meter events one export run sends; the rest wait for the next run.",
    )

    @model_validator(mode="after")
    def _distinct_meters(self) -> "StripeConfig":
        names = list(self.event_names().values())
        if len(set(names)) != len(names):  # two meters on one event_name would each count the other's usage
            raise ValueError(f"the five meter event names must differ, got {names}")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.api_key.get_secret_value())

    def event_names(self) -> dict[str, str]:
        """Meter key (the stable part of identifiers) -> the Stripe meter's event_name."""
        return {
            "input_tokens": self.meter_input_tokens,
            "cached_input_tokens": self.meter_cached_input_tokens,
            "output_tokens": self.meter_output_tokens,
            "gpu_ms": self.meter_gpu_ms,
            "cost": self.meter_cost,
        }
