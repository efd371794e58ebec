"""ServeMeteringSink: the ingress's metering sink, a call to the Metering deployment with a timeout."""

import asyncio
from typing import Any

from ray.serve.handle import DeploymentHandle

from billing.usage import UsageRecord


class ServeMeteringSink:
    def __init__(self, handle: DeploymentHandle[Any], *, timeout_s: float = 30.0) -> None:
        self._handle = handle
        self._timeout = timeout_s

    async def record(self, records: list[UsageRecord]) -> int:
        count: int = await asyncio.wait_for(self._handle.record.remote(records), self._timeout)
        return count
