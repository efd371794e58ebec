"""The engine's public face: the one module of the engine that code outside it imports.

The HTTP app (app/) builds an EngineRequest, streams RequestOutputs back through an EngineClient and
handles the named errors below; the Serve wiring (deployments/) also runs an AsyncEngine and reads its
EngineStats. Everything else under deployments/engine/ is the engine's own business and may change freely;
tests/test_architecture.py holds every caller to this module.

AsyncEngine and LocalEngineClient are loaded on first use: they bring the model classes, kernels and
quantization backends with them, which a process that only talks to a remote engine (the ingress) never
needs.
"""

from collections.abc import AsyncGenerator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from deployments.engine.config import DEFAULT_LORA_TARGETS, DEFAULT_MAX_NUM_SEQS, EngineConfig
from deployments.engine.errors import (
    BudgetTooSmall,
    DuplicateRequestId,
    EmptyPrompt,
    EngineError,
    EngineOverloaded,
    EngineStopped,
    InvalidRequest,
    InvalidSamplingParams,
    PromptTooLong,
    QueueShareExceeded,
    ReplicaLost,
    RequestError,
    RequestFailed,
)
from deployments.engine.outputs import (
    EngineStats,
    FinishReason,
    RequestOutput,
    RequestUsage,
    TokenLogprob,
)
from deployments.engine.request import EngineRequest, Priority
from deployments.engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_TOKEN_IDS,
    MIN_REPETITION_PENALTY,
    SamplingParams,
    StructuredOutput,
)

if TYPE_CHECKING:
    from deployments.engine.async_engine import AsyncEngine
    from deployments.engine.local_client import LocalEngineClient


class EngineClient(Protocol):
    """How the HTTP layer reaches the engine of a base model, wherever it runs: over Ray Serve handles
    (deployments/serve_engine_client.py) or in this process (LocalEngineClient)."""

    def generate(self, base_model: str, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """Stream one request's outputs; named engine errors are raised before the first output. Closing
        the generator early aborts the request. A lost engine replica raises ReplicaLost."""
        ...

    async def abort(self, base_model: str, request_id: str, replica: str | None) -> bool:
        """Ask the engine holding a request (`replica`, from its `accepted` output) to stop it; its stream
        then ends with an ABORT output carrying the usage so far. False if no engine there holds it."""
        ...

    async def ready(self, base_model: str) -> bool:
        """Whether an engine of this base model has its model loaded and takes requests. Cheap; the caller
        bounds how long it may take (a deployment whose replicas are all starting answers late)."""
        ...


def build_native_kernel() -> "Path | None":
    """Build the native CPU LoRA kernel for this machine unless it is built (engines never build it:
    they load what is there). Returns the library, or None if it cannot be built here."""
    from deployments.engine.model import native_kernel

    return native_kernel.build()


_LAZY = {
    "AsyncEngine": "deployments.engine.async_engine",
    "LocalEngineClient": "deployments.engine.local_client",
}


def __getattr__(name: str) -> Any:
    """AsyncEngine and LocalEngineClient, imported when first asked for (PEP 562)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_LORA_TARGETS",
    "DEFAULT_MAX_NUM_SEQS",
    "MAX_LOGIT_BIAS",
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_STOP_TOKEN_IDS",
    "MIN_REPETITION_PENALTY",
    "AsyncEngine",
    "BudgetTooSmall",
    "DuplicateRequestId",
    "EmptyPrompt",
    "EngineClient",
    "EngineConfig",
    "EngineError",
    "EngineOverloaded",
    "EngineRequest",
    "EngineStats",
    "EngineStopped",
    "FinishReason",
    "InvalidRequest",
    "InvalidSamplingParams",
    "LocalEngineClient",
    "Priority",
    "PromptTooLong",
    "QueueShareExceeded",
    "ReplicaLost",
    "RequestError",
    "RequestFailed",
    "RequestOutput",
    "RequestUsage",
    "SamplingParams",
    "StructuredOutput",
    "TokenLogprob",
    "build_native_kernel",
]
