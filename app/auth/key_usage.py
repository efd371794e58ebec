"""KeyUsageRecorder: sets API keys' last_used_at, at most once per key per interval, off the request path.

A request only notes the key in memory; a background task writes the noted keys in one transaction on a
worker thread. So a busy key costs one write per interval per replica, not one per request, and a slow
database never delays a request. A failed write is logged and retried at the key's next use past the
interval: last_used_at is a hint for operators, not a bill.
"""

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

from sqlalchemy.orm import Session

from billing import repository

MAX_KEYS = 100_000
log = logging.getLogger(__name__)


class KeyUsageRecorder:
    def __init__(self, session_factory: Callable[[], Session], *, interval_s: float) -> None:
        self._sessions = session_factory
        self._interval_s = interval_s
        self._noted: dict[str, float] = {}  # key id -> when it was last noted (monotonic)
        self._pending: dict[str, datetime] = {}
        self._flushing: asyncio.Task[None] | None = None

    def used(self, key_id: str) -> None:
        """Note a successful authentication; call on the event loop."""
        now = time.monotonic()
        last = self._noted.get(key_id)
        if last is not None and now - last < self._interval_s:
            return
        if len(self._noted) >= MAX_KEYS:
            self._noted.clear()  # bounded: at worst one extra write per key
        self._noted[key_id] = now
        self._pending[key_id] = datetime.now(UTC)
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, {}
            try:
                await asyncio.to_thread(self._write, batch)
            except Exception as error:
                log.warning("could not record last_used_at of %d API keys: %r", len(batch), error)

    def _write(self, batch: dict[str, datetime]) -> None:
        with self._sessions() as session, session.begin():
            for key_id, at in batch.items():
                repository.touch_key(session, key_id=key_id, now=at)
