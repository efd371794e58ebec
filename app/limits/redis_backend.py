"""The Redis limiter backend: LimiterState's algorithm as Lua scripts, shared by every ingress replica.

Each operation is one script, so admit/release/renew/leave_queue are atomic across replicas, and the clock
is Redis's own (`TIME`): replicas with skewed clocks still agree on every window. The scripts follow
LimiterState step by step (expiry, check order, retry_after values, Decision fields); the suite in
tests/limits holds all backends to the same behaviour.

Keys, per tenant, share the hash tag `{tenant}` (one cluster slot, so one script may touch them all):

    requests      ZSET  request id -> admission (ms)
    tokens:at     ZSET  request id -> admission (ms)    the token window, oldest first
    tokens:n      HASH  request id -> tokens            reserved, then what was used after release
    tokens:total  STRING sum of tokens:n                 kept in step, so admit never sums the hash
    leases        ZSET  request id -> expiry (ms)
    leases:n      HASH  request id -> sequences         the lease's weight against max_concurrent
    delivering    SET   request ids                     leases whose output only waits to be delivered
    queue         ZSET  request id -> arrival (ms)      FIFO order
    queue:seen    ZSET  request id -> last poll (ms)    a ZSET, not a HASH: stale waiters are a range query

Every key gets the same expiry, pushed to at least window + lease TTL on each admit and renew: an idle
tenant leaves nothing behind, and keys that must agree (the token ZSET, hash and total) vanish together.

Every script is all-or-nothing: it validates every argument (bounded integers only) and computes what it
will write before its first write, because Redis does not roll a failed script back.

A queued admit waits here, between script runs: it sleeps until the window makes room (the script's
retry_after), or until a replica publishes that the tenant gave something back (a release, a waiter that
left or went through: one PUBLISH on `<prefix>:wake`, only when the tenant has waiters), and at least every
HEARTBEAT_MS it checks again, which also keeps its place. No fixed short poll, and at most
`max_waiters_per_tenant` waiters per tenant (past them: `queue_full` at once).
"""

import asyncio
import contextlib
import logging
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from app.limits.lua_scripts import INVALID, MAX_LIMIT, lua_script
from app.limits.protocol import (
    DEFAULT_MAX_WAITERS,
    FINAL_REASONS,
    WINDOW_MS,
    Decision,
    InvalidTokenCount,
    LimiterBackend,
    LimiterUnavailable,
    Limits,
    Reason,
    WindowState,
    check_sequences,
    check_tokens,
    check_wait,
)
from app.limits.state import (
    CONCURRENCY_RETRY_MS,
    DELIVERING_RETRY_MS,
    HEARTBEAT_MS,
    QUEUE_STALE_MS,
    QUEUED_RETRY_MS,
)
from app.limits.wakeups import Wakeups

log = logging.getLogger(__name__)
LISTEN_RETRY_S = 1.0  # the wake listener reconnects after this (waiters keep their heartbeat meanwhile)
_KEY_SUFFIXES = (
    "requests",
    "tokens:at",
    "tokens:n",
    "tokens:total",
    "leases",
    "queue",
    "queue:seen",
    "leases:n",
    "delivering",
)
_REASONS: dict[bytes, Reason] = {
    b"requests": "requests",
    b"tokens": "tokens",
    b"concurrency": "concurrency",
    b"delivering": "delivering",
    b"queued": "queued",
    b"queue_full": "queue_full",
    b"too_large": "too_large",
    b"too_many_sequences": "too_many_sequences",
}


def _limit(value: int | None) -> int:
    return -1 if value is None else min(max(0, value), MAX_LIMIT)


class RedisLimiter(LimiterBackend):
    """`timeout_s` bounds every script call as a whole (waiting for a pooled connection, connecting, the
    script); past it, or on any connection error, the call raises LimiterUnavailable. It is a hang guard, not
    a latency target: a refused connection fails at once, and a busy ingress's event loop must not turn a
    burst into 503s (a 0.5 s bound did, on a loaded 2-core machine)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 10.0,
        key_prefix: str = "loraplex:rl",
        max_connections: int = 32,
        max_waiters_per_tenant: int = DEFAULT_MAX_WAITERS,
    ) -> None:
        if "{" in key_prefix or "}" in key_prefix:
            raise ValueError("key_prefix must not contain braces: the tenant is the keys' hash tag")
        self._url = url
        self._timeout = timeout_s
        self._prefix = key_prefix
        self._channel = f"{key_prefix}:wake"
        self._max_waiters = max_waiters_per_tenant
        # Blocking pool: a burst waits for one of max_connections instead of opening more. No retries: a
        # replayed admit could count twice, and the caller decides what an unavailable limiter means.
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._redis = aioredis.Redis.from_pool(pool)
        self._admit = self._redis.register_script(lua_script("admit"))
        self._release = self._redis.register_script(lua_script("release"))
        self._renew = self._redis.register_script(lua_script("renew"))
        self._leave_queue = self._redis.register_script(lua_script("leave_queue"))
        self._deliver = self._redis.register_script(lua_script("deliver"))
        self._peek = self._redis.register_script(lua_script("peek"))
        self._wakeups = Wakeups()
        self._listener: asyncio.Task[None] | None = None  # started by the first waiter

    @property
    def key_prefix(self) -> str:
        return self._prefix

    def keys(self, tenant: str) -> list[str]:
        """The tenant's keys, in the scripts' KEYS order."""
        return [f"{self._prefix}:{{{tenant}}}:{suffix}" for suffix in _KEY_SUFFIXES]

    async def _run(self, script: Any, tenant: str, args: list[int | str]) -> Any:
        try:
            async with asyncio.timeout(self._timeout):
                return await script(keys=self.keys(tenant), args=args)
        except ResponseError as error:
            if INVALID in str(error):  # refused before the script wrote anything
                raise InvalidTokenCount(str(error)) from error
            raise LimiterUnavailable(f"redis rate limiter unavailable: {error!r}") from error
        except (RedisError, TimeoutError, OSError) as error:
            # Connections that sat idle through an outage are dead but look open; without this, each
            # fails once on its next use, long after Redis came back.
            await self._redis.connection_pool.disconnect(inuse_connections=False)
            raise LimiterUnavailable(f"redis rate limiter unavailable: {error!r}") from error

    async def admit(
        self,
        tenant: str,
        request_id: str,
        limits: Limits,
        reserve_tokens: int,
        *,
        wait_ms: int = 0,
        sequences: int = 1,
    ) -> Decision:
        reserve, wait_ms = check_tokens("reserve_tokens", reserve_tokens), check_wait(wait_ms)
        sequences = check_sequences(sequences)
        queued = wait_ms > 0
        decision = await self._admit_once(tenant, request_id, limits, reserve, sequences, queued=queued)
        if decision.admitted or not queued or decision.reason in FINAL_REASONS:
            return decision
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_ms / 1000
        waiter = self._wakeups.join(tenant, request_id)
        self._listen(loop)
        try:
            while not waiter.left and (left := deadline - loop.time()) > 0:
                await waiter.nap(min(left, _nap_ms(decision) / 1000))
                if waiter.left:
                    break
                decision = await self._admit_once(tenant, request_id, limits, reserve, sequences, queued=True)
                if decision.admitted or decision.reason == "queue_full":
                    return decision
        finally:
            self._wakeups.leave(tenant, request_id, waiter)
        try:  # out of time: give the place up now rather than when it goes stale
            await self._run(self._leave_queue, tenant, [request_id, self._channel, tenant])
        except LimiterUnavailable as error:
            log.warning("leaving the queue failed (the place goes stale by itself): %s", error)
        return decision

    async def _admit_once(
        self, tenant: str, request_id: str, limits: Limits, reserve: int, sequences: int, *, queued: bool
    ) -> Decision:
        args: list[int | str] = [
            request_id,
            _limit(limits.rpm),
            _limit(limits.tpm),
            _limit(limits.max_concurrent),
            limits.lease_ttl_ms,
            reserve,
            int(queued),
            WINDOW_MS,
            QUEUE_STALE_MS,
            CONCURRENCY_RETRY_MS,
            QUEUED_RETRY_MS,
            self._max_waiters,
            self._channel,
            tenant,
            sequences,
            DELIVERING_RETRY_MS,
        ]
        reply = await self._run(self._admit, tenant, args)
        admitted, reason, retry_after, requests, reset_requests, tokens, reset_tokens = reply
        if admitted and queued:
            self._wakeups.wake_first(tenant)  # this replica's next waiter need not wait for the publish
        return Decision(
            admitted=bool(admitted),
            reason=_REASONS[reason] if reason else None,
            retry_after_ms=int(retry_after),
            limit_requests=limits.rpm,
            remaining_requests=None if limits.rpm is None else limits.rpm - int(requests),
            reset_requests_ms=int(reset_requests),
            limit_tokens=limits.tpm,
            remaining_tokens=None if limits.tpm is None else limits.tpm - int(tokens),
            reset_tokens_ms=int(reset_tokens),
        )

    async def release(self, tenant: str, request_id: str, used_tokens: int) -> None:
        used = check_tokens("used_tokens", used_tokens)
        await self._run(self._release, tenant, [request_id, used, self._channel, tenant])
        self._wakeups.wake_first(tenant)

    async def renew(self, tenant: str, request_id: str, limits: Limits) -> None:
        await self._run(self._renew, tenant, [request_id, limits.lease_ttl_ms, WINDOW_MS])

    async def deliver(self, tenant: str, request_id: str) -> None:
        await self._run(self._deliver, tenant, [request_id, WINDOW_MS])

    async def leave_queue(self, tenant: str, request_id: str) -> None:
        waiter = self._wakeups.get(tenant, request_id)
        if waiter is not None:  # it waits in this process: end that wait, or its next check re-queues it
            waiter.left = True
            waiter.wake()
        await self._run(self._leave_queue, tenant, [request_id, self._channel, tenant])
        self._wakeups.wake_first(tenant)

    async def peek(self, tenant: str) -> WindowState:
        reply = await self._run(self._peek, tenant, [WINDOW_MS, QUEUE_STALE_MS])
        requests, reset_requests, tokens, reset_tokens, in_flight, queued = (int(v) for v in reply)
        return WindowState(
            requests=requests,
            tokens=tokens,
            in_flight=in_flight,
            queued=queued,
            reset_requests_ms=reset_requests,
            reset_tokens_ms=reset_tokens,
        )

    def _listen(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the wake listener on this loop, unless it runs already."""
        if self._listener is None or self._listener.done() or self._listener.get_loop() is not loop:
            self._listener = loop.create_task(self._wake_listener())

    async def _wake_listener(self) -> None:
        """Other replicas publish a tenant's name when it gives something back: wake our first waiter of
        that tenant. Own connection (it blocks on SUBSCRIBE); reconnects after errors, while waiters fall
        back on their heartbeat."""
        while True:
            client = aioredis.Redis.from_url(self._url, socket_connect_timeout=self._timeout)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self._channel)
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        self._wakeups.wake_first(message["data"].decode())
            except (RedisError, OSError) as error:
                log.debug("rate limiter wake listener lost Redis, retrying: %r", error)
            finally:
                # Bounded: closing a subscription that a cancel interrupted can wait on its connection for
                # good (seen as a 420 s hang in a test's teardown); a lost close only leaks one socket.
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    async with asyncio.timeout(self._timeout):
                        await pubsub.aclose()  # type: ignore[no-untyped-call]
                        await client.aclose()
            await asyncio.sleep(LISTEN_RETRY_S)

    async def aclose(self) -> None:
        """Close the pool's connections and the listener (the limiter cannot be used afterwards)."""
        if self._listener is not None and not self._listener.done():
            self._listener.cancel()
            await asyncio.wait({self._listener}, timeout=self._timeout)  # never hang a shutdown on it
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._timeout):
                await self._redis.aclose()


def _nap_ms(decision: Decision) -> int:
    """How long a waiter sleeps before checking again, unless woken: until the window makes room for it,
    at most a heartbeat (which keeps its place, and notices leases that expired instead of being released)."""
    if decision.reason in ("requests", "tokens"):
        return max(1, min(HEARTBEAT_MS, decision.retry_after_ms))
    return HEARTBEAT_MS
