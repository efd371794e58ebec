"""Admin API bodies for adapters."""

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class AdapterVersionOut(BaseModel):
    version: int
    rank: int
    target_modules: list[str]
    sha256: str = Field(description="SHA-256 of adapter_model.safetensors.")
    size_bytes: int
    created_at: datetime


class AdapterOut(BaseModel):
    id: str
    object: Literal["adapter"] = "adapter"
    name: str
    owner: str = Field(description='A tenant id, or "public".')
    base_model: str
    version: int = Field(description="The newest version; new requests use it.")
    status: Literal["ready", "deleted"]
    rank: int
    target_modules: list[str]
    sha256: str
    size_bytes: int
    pinned: bool
    model: str = Field(description="How the owner names it in requests (public ones: `public/<name>`).")
    created_at: datetime
    updated_at: datetime
    deleted_at: datetime | None
    versions: list[AdapterVersionOut] | None = Field(default=None, description="Every version (detail view).")


class AdapterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdapterOut]


class AdapterPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pinned: bool = Field(description="Keep the newest version in a device slot on every engine replica.")
