"""RequestMetrics: the ingress's per-request Prometheus metrics, by tenant, model and engine replica.

Requests that reached an engine are counted when their RequestRecord arrives (an observer, beside metering),
with the tokens and timings the engine measured. Requests refused before that (rate limits, bad input, an
engine that would not take them) are counted by `refused`, so every generation request is counted once.
"""

from typing import Literal

from adapters.errors import AdapterError
from app.errors import APIError, to_api_error
from app.limits import LimiterUnavailable
from app.metering.request_record import RequestRecord, RequestStatus
from app.metrics import LATENCY_MS, QUEUE_MS, TPOT_MS, TTFT_MS, Counter, Histogram
from deployments.engine.interface import EngineError

RefusedStatus = Literal["rejected", "invalid", "failed", "aborted"]
Status = RequestStatus | RefusedStatus

# model: as the client named it (an adapter's name, or the base model); engine_replica: "" if none served it.
TAGS = ("tenant", "model", "base_model", "engine_replica")

REQUESTS = Counter(
    "loraplex_requests",
    "Generation requests by how they ended: completed, aborted (the client left), failed, rejected "
    "(rate limits or the limiter unavailable), invalid (refused as bad input).",
    (*TAGS, "status"),
)
PROMPT_TOKENS = Counter("loraplex_prompt_tokens", "Prompt tokens processed.", TAGS)
CACHED_TOKENS = Counter("loraplex_cached_prompt_tokens", "Prompt tokens served from the prefix cache.", TAGS)
COMPLETION_TOKENS = Counter("loraplex_completion_tokens", "Tokens generated.", TAGS)
TTFT = Histogram("loraplex_ttft_ms", "Engine arrival to first token (ms).", TAGS, TTFT_MS)
TPOT = Histogram(
    "loraplex_time_per_output_token_ms", "Time per output token after the first (ms).", TAGS, TPOT_MS
)
QUEUE = Histogram("loraplex_queue_ms", "Engine arrival to first scheduled (ms).", TAGS, QUEUE_MS)
LATENCY = Histogram(
    "loraplex_request_latency_ms", "Ingress start to end, streams included (ms).", TAGS, LATENCY_MS
)


class RequestMetrics:
    """A RequestObserver."""

    async def on_finish(self, record: RequestRecord) -> None:
        usage = record.usage
        tags = {
            "tenant": record.tenant_id,
            "model": record.model,
            "base_model": record.base_model,
            "engine_replica": (usage.replica if usage is not None else None) or "",
        }
        REQUESTS.inc({**tags, "status": record.status})
        LATENCY.observe(record.latency_ms, tags)
        if usage is None:
            return
        PROMPT_TOKENS.inc(tags, usage.prompt_tokens)
        CACHED_TOKENS.inc(tags, usage.cached_prompt_tokens)
        COMPLETION_TOKENS.inc(tags, usage.completion_tokens)
        QUEUE.observe(usage.queue_ms, tags)
        if usage.ttft_ms is not None:
            TTFT.observe(usage.ttft_ms, tags)
            if usage.completion_tokens > 1:
                decode_ms = usage.total_ms - usage.ttft_ms
                TPOT.observe(max(0.0, decode_ms) / (usage.completion_tokens - 1), tags)


def refused(tenant: str, model: str, base_model: str, error: BaseException) -> None:
    """Count a generation request that ended before any engine took it."""
    tags = {"tenant": tenant, "model": model, "base_model": base_model, "engine_replica": ""}
    REQUESTS.inc({**tags, "status": refusal_status(error)})


def refusal_status(error: BaseException) -> RefusedStatus:
    if not isinstance(error, Exception):  # cancelled: the client left (e.g. while queued for its limits)
        return "aborted"
    if isinstance(error, LimiterUnavailable) or (isinstance(error, APIError) and error.status == 429):
        return "rejected"
    if isinstance(error, APIError | AdapterError | EngineError) and to_api_error(error).status < 500:
        return "invalid"
    return "failed"
