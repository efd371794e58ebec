"""LocalEngineClient: the EngineClient for engines running in this process (tests, single-process tools);
the Ray Serve ingress uses deployments/serve_engine_client.py instead."""

from collections.abc import AsyncGenerator

from deployments.engine.async_engine import AsyncEngine
from deployments.engine.outputs import RequestOutput
from deployments.engine.request import EngineRequest


class LocalEngineClient:
    def __init__(self, engines: dict[str, AsyncEngine]) -> None:
        self.engines = engines

    def generate(self, base_model: str, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        return self.engines[base_model].generate(request)

    async def abort(self, base_model: str, request_id: str, replica: str | None) -> bool:
        engine = self.engines.get(base_model)
        return engine is not None and await engine.abort(request_id)

    async def ready(self, base_model: str) -> bool:
        engine = self.engines.get(base_model)
        return engine is not None and engine.running
