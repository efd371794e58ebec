"""Admin API bodies: tenants, tiers and API keys."""

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TenantCreate(_Body):
    name: str = Field(min_length=1, max_length=128, description="Unique tenant name.")
    tier: str = Field(default="free", min_length=1, max_length=64, description="Pricing tier.")


class TenantUpdate(_Body):
    name: str | None = Field(default=None, min_length=1, max_length=128)
    tier: str | None = Field(default=None, min_length=1, max_length=64)


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
