"""Readiness: whether this ingress can serve requests now, check by check.

Ready means every base model has an engine with its model loaded, the billing database answers
`SELECT 1` at this code's schema revision, and the rate limiter backend answers. The checks run
concurrently, each bounded by a timeout, so a hung dependency makes /readyz say so instead of hanging it.
The answer names a failure's kind only; its details (hosts, users, driver messages) go to the log, not to
whoever can reach /readyz. A database that was never migrated, or is behind, is the exception: the answer
names the revision found, the one expected and the command that fixes it, which reveal only the release.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable

from sqlalchemy import text

from app.limits.peek_cache import PeekCache
from app.services import Services
from billing.schema_gate import DatabaseNotMigrated

CHECK_TIMEOUT_S = 2.0
PROBE = "__readyz__"  # the limiter probe's tenant: nobody's
OK = "ok"
log = logging.getLogger(__name__)


class Readiness:
    def __init__(self, services: Services, *, timeout_s: float = CHECK_TIMEOUT_S) -> None:
        self.services = services
        self.timeout_s = timeout_s
        self._database_probe: asyncio.Future[None] | None = None
        self._limiter_peeks: PeekCache | None = None

    async def check(self) -> dict[str, str]:
        """Check name -> "ok", or what is wrong."""
        checks: dict[str, Callable[[], Awaitable[None]]] = {
            "database": self._database,
            "limiter": self._limiter,
            **{f"engine:{name}": self._engine(name) for name in self.services.catalog.names()},
        }
        results = await asyncio.gather(*(self._bounded(name, probe) for name, probe in checks.items()))
        return dict(zip(checks, results, strict=True))

    async def _bounded(self, name: str, probe: Callable[[], Awaitable[None]]) -> str:
        try:
            async with asyncio.timeout(self.timeout_s):
                await probe()
        except TimeoutError:
            log.warning("readiness: %s did not answer within %gs", name, self.timeout_s)
            return f"no answer within {self.timeout_s:g}s"
        except DatabaseNotMigrated as error:
            return str(error)
        except Exception as error:
            log.warning("readiness: %s failed: %r", name, error)
            return "failed"  # /readyz is unauthenticated: what failed, and how, goes to the log only
        return OK

    async def _database(self) -> None:
        def select_one() -> None:
            with self.services.session_factory() as session:
                session.execute(text("SELECT 1"))

        # In a thread, which a timeout abandons (a driver stuck connecting cannot be interrupted); while
        # one probe is stuck, later checks wait on it rather than pile up more stuck threads.
        if self._database_probe is None or self._database_probe.done():
            self._database_probe = asyncio.ensure_future(asyncio.to_thread(select_one))
            self._database_probe.add_done_callback(_retrieve)  # an abandoned probe's error is not "lost"
        await asyncio.shield(self._database_probe)

    async def _limiter(self) -> None:
        # The read-only peek, cached for a second: /readyz is unauthenticated, and a loop of probes must
        # not become a loop of round trips to the limiter that every admission needs.
        self._limiter_peeks = PeekCache.reuse(self._limiter_peeks, self.services.limiter)
        await self._limiter_peeks.peek(PROBE)

    def _engine(self, base_model: str) -> Callable[[], Awaitable[None]]:
        async def probe() -> None:
            if not await self.services.engine.ready(base_model):
                raise RuntimeError("no engine with the model loaded")

        return probe


def _retrieve(future: "asyncio.Future[None]") -> None:
    if not future.cancelled():
        future.exception()
