"""EngineRequest: one generation request as it crosses from the ingress to an engine (picklable)."""

from dataclasses import dataclass

from adapters.ref import AdapterRef
from deployments.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: AdapterRef | None = None
    cache_salt: str | None = None  # prefix-cache scope; the ingress passes the tenant id
