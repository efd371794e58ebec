"""EngineRequest: one generation request as it crosses from the ingress to an engine (picklable)."""

from dataclasses import dataclass
from typing import Literal

from adapters.ref import AdapterRef
from deployments.engine.sampling_params import SamplingParams

Priority = Literal["interactive", "batch"]


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: AdapterRef | None = None
    cache_salt: str | None = None  # prefix-cache scope; the ingress passes the tenant id
    # Send an `accepted` output as soon as the engine queued the request, naming the replica: a caller who
    # leaves later knows whom to ask to abort it and that it must wait for the final usage.
    announce: bool = False
    # The rest of a list of prompts (/v1/completions): one request, one stream, one usage for all of them.
    # Prompt p's choice j (of params.n) has index p * n + j.
    more_prompts: tuple[list[int], ...] = ()
    # Whom it is for, an opaque id (the ingress passes the tenant id; None is one more party): while
    # others wait, one party's sequences take at most half of the engine's waiting queue.
    tenant: str | None = None
    # The most GPU time (ms, all choices together) the request may be charged: the engine ends it with
    # finish_reason LENGTH (RequestOutput.gpu_limited) after the step that reaches it, and reports at most
    # this much in its usage (the crossing step's excess is not charged), so a budget hold that includes
    # it (app/budgets/guard.py) is never exceeded. None: no bound.
    max_gpu_ms: float | None = None
    # The tenant's share of the engine against other tenants (scheduling "fair"): served service is divided
    # by it, so a tenant of weight 2 is served about twice what one of weight 1 is while both wait.
    tenant_weight: float = 1.0
    # Its class: "batch" sequences take only rows no "interactive" sequence wants (admitted after every
    # waiting interactive one, preempted first for one, and first when KV blocks run out).
    priority: Priority = "interactive"
    # True: the caller answers only at the end (a non-streamed request, a Batch API line), so the engine
    # sends the announcement and each choice's whole output once that choice ends, not one output a step:
    # no thread hop, no wake of the caller (and no message across Ray) for each of its tokens.
    whole: bool = False

    def __post_init__(self) -> None:
        if not self.tenant_weight > 0:  # also refuses NaN
            raise ValueError(f"tenant_weight must be > 0, got {self.tenant_weight}")
        if self.priority not in ("interactive", "batch"):
            raise ValueError(f"priority must be 'interactive' or 'batch', got {self.priority!r}")

    @property
    def prompts(self) -> list[list[int]]:
        return [self.prompt_ids, *self.more_prompts]
