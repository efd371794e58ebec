"""ServeEngineClient: EngineClient over Ray Serve deployment handles, one per base model."""

from collections.abc import AsyncGenerator
from typing import Any

from ray.exceptions import RayTaskError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from adapters.errors import AdapterError
from deployments.engine.errors import EngineError
from deployments.engine.outputs import RequestOutput
from deployments.engine.request import EngineRequest


class ServeEngineClient:
    def __init__(self, handles: dict[str, DeploymentHandle[Any]]) -> None:
        self._handles = {name: h.options(stream=True) for name, h in handles.items()}

    async def generate(self, base_model: str, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        stream = self._handles[base_model].generate.remote(request)
        assert isinstance(stream, DeploymentResponseGenerator)
        finished = False
        try:
            async for output in stream:
                finished = output.finished
                yield output
        except RayTaskError as error:  # give the app the replica's own named error
            cause = error.cause
            if isinstance(cause, EngineError | AdapterError):
                raise cause from None
            raise
        finally:
            if not finished:  # our caller left early: cancel on the replica, which aborts the request
                stream.cancel()  # type: ignore[no-untyped-call]
