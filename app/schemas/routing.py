"""GET /admin/routing: how well requests met replicas that already held their adapter."""

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ReplicaRoutingOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # read from billing.routing_report's dataclasses

    replica: str
    adapter_requests: int = Field(description="Requests naming an adapter that this replica received.")
    adapter_hits: int = Field(
        description="...of which found the adapter already resident (slot or CPU tier)."
    )
    hit_rate: float | None = Field(description="adapter_hits / adapter_requests; null without requests.")
    loads: int = Field(description="Adapter reads from the store on this replica.")
    adapter_loads: dict[str, int] = Field(description='Reads per adapter version ("name@vN").')
    reported_at: datetime


class ModelRoutingOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    object: Literal["routing.model"] = "routing.model"
    base_model: str
    adapter_requests: int
    adapter_hits: int
    hit_rate: float | None
    loads: int = Field(description="Adapter reads from the store, over all replicas.")
    duplicate_loads: int = Field(
        description="Loads of an adapter version on a replica beyond the first replica that loaded it."
    )
    replicas: list[ReplicaRoutingOut]


class RoutingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelRoutingOut]
