"""Sequence: one request's state inside the engine, from arrival to finish."""

import enum
import time
from dataclasses import dataclass, field

import torch

from adapters.ref import AdapterRef
from deployments.engine.outputs import FinishReason
from deployments.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks and an adapter slot
    FINISHED = "finished"


@dataclass(slots=True)
class SequenceMetrics:
    """What metering needs. Times are time.monotonic() seconds; gpu_time is seconds of device busy time."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    gpu_time: float = 0.0
    cached_prompt_tokens: int = 0
    prompt_processed: int = 0  # most prompt tokens ever in the KV cache (preemption resets num_computed)
    num_preemptions: int = 0


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: AdapterRef | None
    max_tokens: int  # params.max_tokens, clamped to the context left after the prompt
    generator: torch.Generator | None = None
    cache_salt: str | None = None  # prefix-cache scope, e.g. the tenant: no sharing across salts
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # digests of the leading full, computed blocks
    slot: int = -1  # device adapter slot while running; -1: base model
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    metrics: SequenceMetrics = field(default_factory=lambda: SequenceMetrics(arrival=time.monotonic()))

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
