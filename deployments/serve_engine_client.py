"""ServeEngineClient: EngineClient over Ray Serve deployment handles, one per base model.

It translates the transport's failures into the engine interface's terms: a replica that died, or whose
engine loop stopped, raises ReplicaLost (with how many tokens it had delivered); the replica's own named
errors (bad input, unknown adapter, overload) are raised as themselves. It never retries: whether a lost
request may run again depends on what its client has seen, which only the caller knows
(app/completions/generation.py holds the platform's one failover).

Engine calls are made detached from the ingress request that makes them: when an HTTP client leaves,
Serve and Ray cancel the ingress's request and, by default, every call it made, so the engine replica
would stop the request before the ingress could ask it for the usage so far. The ingress stops them
itself instead (`abort`), reads the final output, and bills it.
"""

import contextvars
import dataclasses
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

from ray.exceptions import RayActorError, RayTaskError
from ray.serve import context as serve_context
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from adapters.errors import AdapterError
from deployments.abort_request import AbortRequest
from deployments.engine.interface import EngineError, EngineRequest, EngineStopped, ReplicaLost, RequestOutput

T = TypeVar("T")


def _detached(call: Callable[[], T]) -> T:
    """Make a handle call that its caller's cancellation does not cancel: Serve's request context with
    `cancel_on_parent_request_cancel` off, and no Ray task id to cancel recursively (a fresh context)."""
    parent = serve_context._get_serve_request_context()

    def in_fresh_context() -> T:
        own = dataclasses.replace(parent, cancel_on_parent_request_cancel=False)
        serve_context._serve_request_context.set(own)  # type: ignore[arg-type]
        return call()

    return contextvars.Context().run(in_fresh_context)


class ServeEngineClient:
    def __init__(self, handles: dict[str, DeploymentHandle[Any]]) -> None:
        self._plain = dict(handles)
        self._handles = {name: h.options(stream=True) for name, h in handles.items()}

    async def generate(self, base_model: str, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        stream = _detached(lambda: self._handles[base_model].generate.remote(request))
        assert isinstance(stream, DeploymentResponseGenerator)
        finished, delivered = False, 0
        try:
            async for output in stream:
                finished = output.finished
                delivered += len(output.token_ids)
                yield output
        except RayTaskError as error:  # give the app the replica's own named error
            cause = error.cause
            if isinstance(cause, RayActorError | EngineStopped):
                raise ReplicaLost(request.request_id, delivered) from None
            if isinstance(cause, EngineError | AdapterError):
                raise cause from None
            raise
        except RayActorError:  # the replica died, or is unreachable, mid-request
            raise ReplicaLost(request.request_id, delivered) from None
        finally:
            if not finished:  # our caller left early, or the replica is gone: cancel, which aborts
                stream.cancel()  # type: ignore[no-untyped-call]

    async def abort(self, base_model: str, request_id: str, replica: str | None) -> bool:
        handle = self._plain.get(base_model)
        if handle is None or replica is None:
            return False
        unique_id = replica.removeprefix(f"{base_model}:")  # EngineReplica names itself model:unique_id
        response = _detached(lambda: handle.abort.remote(AbortRequest(request_id, unique_id)))
        try:
            return bool(await response)
        except BaseException:  # the caller's bound ran out: don't leave the call queued
            response.cancel()  # type: ignore[no-untyped-call]
            raise

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
