"""The background retry of an idempotent call that failed on a request's path (a limiter lease's release, a
budget's settle): tried again off that path, with backoff, until it lands or its deadline passes. The
response never waits on it."""

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

FIRST_WAIT_S = 0.5
RUNNING: set["asyncio.Future[bool]"] = set()  # retries in flight, kept from the garbage collector


def retry_in_background(
    call: Callable[[], Awaitable[object]],
    *,
    what: str,
    within_s: float,
    max_wait_s: float,
    gave_up: str,
    gave_up_level: int = logging.WARNING,
) -> "asyncio.Future[bool]":
    """Call `call` again after FIRST_WAIT_S, doubling the wait up to `max_wait_s`, until it succeeds or
    `within_s` has passed; the retry, done with whether it landed. `call` must be idempotent (it may have
    landed when it seemed to fail). `what` names the work in the log ("settling req_1"), `gave_up` says
    what giving up leaves behind, logged at `gave_up_level`."""
    retry = asyncio.ensure_future(_until_done(call, what, within_s, max_wait_s, gave_up, gave_up_level))
    RUNNING.add(retry)
    retry.add_done_callback(RUNNING.discard)
    return retry


async def _until_done(
    call: Callable[[], Awaitable[object]],
    what: str,
    within_s: float,
    max_wait_s: float,
    gave_up: str,
    level: int,
) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    wait, failures = FIRST_WAIT_S, 0
    while loop.time() < deadline:
        await asyncio.sleep(min(wait, max(0.0, deadline - loop.time())))
        try:
            await call()
        except Exception as error:
            failures += 1
            wait = min(wait * 2, max_wait_s)
            if failures % 10 == 0:
                log.warning("%s still fails (%d tries): %s", what, failures, error)
            continue
        log.info("%s done after %d failed tries", what, failures + 1)  # the first, on the request's path
        return True
    log.log(level, "gave up %s after %.0f s: %s", what, within_s, gave_up)
    return False
