"""DatabaseSink: the metering sink that writes usage records straight into the billing database.

The Metering deployment uses it on its side of a Ray call; a single-process platform (tests, tools) uses
it directly from the ingress.
"""

from collections.abc import Callable

from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from billing.usage import UsageRecord, record_usage


class DatabaseSink:
    def __init__(self, session_factory: Callable[[], Session]) -> None:
        self._sessions = session_factory

    async def record(self, records: list[UsageRecord]) -> int:
        return await run_in_threadpool(self.write, records)

    def write(self, records: list[UsageRecord]) -> int:
        """Insert-or-ignore in one transaction; returns how many were new."""
        with self._sessions() as session, session.begin():
            return record_usage(session, records)
