"""GET /admin/engines: tenant isolation inside each engine replica."""

from collections import Counter
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field


class TenantIsolationOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # read from billing.isolation_report's dataclasses

    tenant_id: str = Field(description='The tenant\'s id ("" for requests without one).')
    tenant_name: str | None
    service: float = Field(
        description="Weighted service served since the replica started, divided by the tier's weight (the "
        "fair order's counter: prompt tokens 1, cached prompt tokens 0.25, output tokens 2)."
    )
    waiting: int = Field(description="Sequences of the tenant waiting now.")
    oldest_wait_s: float | None = Field(description="How long its oldest waiting sequence has waited.")


class ReplicaIsolationOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    object: Literal["engine.replica"] = "engine.replica"
    replica: str
    base_model: str
    reported_at: datetime
    tenants: list[TenantIsolationOut] = Field(description="Most served first.")
    preemptions: dict[str, int] = Field(
        description="Sequences preempted since start, by reason: kv, adapter_slot, fair, batch."
    )
    adapter_queue: dict[str, int] = Field(
        description='Sequences waiting per adapter version ("name@vN"), for the engine\'s stats_top_adapters '
        "deepest queues only."
    )
    adapter_queue_other: int = Field(description="Sequences waiting for every adapter not in adapter_queue.")
    adapters_queued: int = Field(description="Adapter versions with sequences waiting.")
    adapter_rotation: list[str] = Field(
        description="Adapters waiting for a device slot, the next to get one first (the first "
        "stats_top_adapters)."
    )
    resident_ranks: dict[str, int] = Field(description="The LoRA rank of each adapter in a device slot.")
    adapter_pages: dict[str, int] = Field(
        default_factory=dict,
        description='Device adapter memory in pages: "total", "in_use" (the resident adapters\' runs) and '
        '"page_rank" (rank units a page holds; an adapter of rank r takes ceil(r / page_rank) pages).',
    )

    @computed_field(  # type: ignore[prop-decorator]
        description='How many resident adapters have each LoRA rank (rank as a string: "8", "64").'
    )
    @property
    def resident_by_rank(self) -> dict[str, int]:
        return {str(rank): count for rank, count in sorted(Counter(self.resident_ranks.values()).items())}


class EngineList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ReplicaIsolationOut]
