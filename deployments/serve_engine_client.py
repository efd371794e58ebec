"""ServeEngineClient: EngineClient over Ray Serve deployment handles, one per base model.

Failover: when the replica running a request dies (or its engine loop stops) before the request has
produced any output, the request is sent again, and Serve's router, told of the death, picks another
replica. Once output has been delivered it cannot be taken back, so the caller gets ReplicaLost (a clear
503) instead; a non-streaming caller, whose client has seen nothing yet, may restart the request itself.
"""

import logging
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from adapters.errors import AdapterError
from deployments.engine.errors import EngineError, EngineStopped, ReplicaLost
from deployments.engine.outputs import RequestOutput
from deployments.engine.request import EngineRequest

log = logging.getLogger(__name__)


class ServeEngineClient:
    def __init__(self, handles: dict[str, DeploymentHandle[Any]], *, attempts: int = 3) -> None:
        self._plain = dict(handles)
        self._handles = {name: h.options(stream=True) for name, h in handles.items()}
        self._attempts = attempts

    async def generate(self, base_model: str, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        original_id = request.request_id
        for attempt in range(1, self._attempts + 1):
            if attempt > 1:  # a fresh engine id, in case the lost attempt's abort is still pending somewhere
                request = replace(request, request_id=f"{original_id}.a{attempt}")
            stream = self._handles[base_model].generate.remote(request)
            assert isinstance(stream, DeploymentResponseGenerator)
            started, finished, delivered = False, False, 0
            try:
                async for output in stream:
                    started, finished = True, output.finished
                    delivered += len(output.token_ids)
                    yield output
                return
            except RayTaskError as error:  # give the app the replica's own named error
                cause = error.cause
                lost = isinstance(cause, RayActorError | EngineStopped)
                if not lost and isinstance(cause, EngineError | AdapterError):
                    raise cause from None
                if not lost:
                    raise
                if started or attempt == self._attempts:
                    raise ReplicaLost(request.request_id, delivered) from None
            except RayActorError:  # the replica died, or is unreachable, mid-request
                if started or attempt == self._attempts:
                    raise ReplicaLost(request.request_id, delivered) from None
            finally:
                if not finished:  # our caller left early, or the replica is gone: cancel, which aborts
                    stream.cancel()  # type: ignore[no-untyped-call]
            log.warning("request %s lost its engine replica before any output; retrying", request.request_id)

    async def ready(self, base_model: str) -> bool:
        """One replica of the deployment answers that its engine runs. A replica only takes calls once its
        constructor (the model load) finished, so a deployment still loading answers late, not wrongly."""
        handle = self._plain.get(base_model)
        if handle is None:
            return False
        response = handle.ready.remote()
        try:
            return bool(await response)
        except BaseException:  # e.g. the caller's timeout: don't leave the call queued for a replica
            response.cancel()  # type: ignore[no-untyped-call]
            raise
