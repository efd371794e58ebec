"""EngineClient: how the HTTP layer reaches the engine of a base model, whatever hosts it.

The Ray Serve ingress implements it with deployment handles (deployments/ingress.py); LocalEngineClient
serves engines living in this process (tests, single-process tools). Both stream RequestOutput.
"""

from collections.abc import AsyncGenerator
from typing import Protocol

from deployments.engine.async_engine import AsyncEngine
from deployments.engine.outputs import RequestOutput
from deployments.engine.request import EngineRequest


class EngineClient(Protocol):
    def generate(self, base_model: str, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """Stream one request's outputs; named engine errors are raised before the first output.
        Closing the generator early aborts the request."""
        ...

    async def ready(self, base_model: str) -> bool:
        """Whether an engine of this base model has its model loaded and takes requests. Cheap; the caller
        bounds how long it may take (a deployment whose replicas are all starting answers late)."""
        ...


class LocalEngineClient:
    def __init__(self, engines: dict[str, AsyncEngine]) -> None:
        self.engines = engines

    def generate(self, base_model: str, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        return self.engines[base_model].generate_request(request)

    async def ready(self, base_model: str) -> bool:
        engine = self.engines.get(base_model)
        return engine is not None and engine.running
