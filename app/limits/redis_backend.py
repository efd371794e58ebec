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

from app.limits.protocol import (
    DEFAULT_MAX_WAITERS,
    FINAL_REASONS,
    MAX_TOKENS,
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
from app.limits.state import CONCURRENCY_RETRY_MS, HEARTBEAT_MS, QUEUE_STALE_MS, QUEUED_RETRY_MS
from app.limits.wakeups import Wakeups

log = logging.getLogger(__name__)
MAX_LIMIT = 10**15  # a limit above this is no limit that could bind; sent clamped, as Lua integers stay exact
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
)
_REASONS: dict[bytes, Reason] = {
    b"requests": "requests",
    b"tokens": "tokens",
    b"concurrency": "concurrency",
    b"queued": "queued",
    b"queue_full": "queue_full",
    b"too_large": "too_large",
    b"too_many_sequences": "too_many_sequences",
}
_INVALID = "loraplex invalid argument"  # the scripts' error replies for arguments they refuse

# Shared by every script. Lua 5.1's unpack() overflows the C stack past ~8000 values: big batches go in
# chunks. Server time, in ms: the one clock every replica agrees on.
_PRELUDE = """
local REQUESTS, TOKENS_AT, TOKENS_N, TOKENS_TOTAL, LEASES, QUEUE, QUEUE_SEEN = 1, 2, 3, 4, 5, 6, 7
local LEASES_N = 8

-- ARGV[i] as an integer in [lo, hi], or an error reply before the script has written anything.
local function int_arg(i, lo, hi)
  local n = tonumber(ARGV[i])
  if n == nil or n ~= math.floor(n) or n < lo or n > hi then
    error({err = 'INVALID_ARGUMENT_PREFIX: ARGV[' .. i .. '] = ' .. tostring(ARGV[i]) ..
      ' is not an integer in [' .. lo .. ', ' .. hi .. ']'})
  end
  return n
end

-- Wake the tenant's waiters on other replicas, only when it has any.
local function wake_waiters(channel, tenant)
  if redis.call('ZCARD', KEYS[QUEUE]) > 0 then redis.call('PUBLISH', channel, tenant) end
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function chunked(cmd, key, ids)
  for i = 1, #ids, 1000 do
    redis.call(cmd, key, unpack(ids, i, math.min(i + 999, #ids)))
  end
end

-- One expiry for every key of the tenant, never shortened (a lease may have been granted a longer TTL).
local function keep_alive(ms)
  for i = 1, #KEYS do
    local left = redis.call('PTTL', KEYS[i])
    if left > ms then ms = left end
  end
  for i = 1, #KEYS do redis.call('PEXPIRE', KEYS[i], ms) end
end

-- Sequences held by the leases named in ids (a lease without a weight, from before weights, holds one).
local function weight_of(ids)
  local sum = 0
  for i = 1, #ids, 1000 do
    local weights = redis.call('HMGET', KEYS[LEASES_N], unpack(ids, i, math.min(i + 999, #ids)))
    for j = 1, #weights do sum = sum + (tonumber(weights[j]) or 1) end
  end
  return sum
end
"""


def _lua(body: str) -> str:
    """A script: the prelude, then `body`, with the bounds filled in."""
    script = _PRELUDE + body
    for name, value in (("MAX_LIMIT_VALUE", MAX_LIMIT), ("MAX_TOKENS_VALUE", MAX_TOKENS)):
        script = script.replace(name, str(value))
    return script.replace("INVALID_ARGUMENT_PREFIX", _INVALID)


# ARGV: request id, rpm, tpm, max_concurrent (-1: unlimited), lease TTL, reserve, queued (0/1),
# window, queue stale, concurrency retry, queued retry (all ms), max waiters (-1: unbounded), wake channel,
# tenant, sequences (the lease's weight). Returns {admitted, reason, retry_after, requests in window,
# reset_requests, token total, reset_tokens}.
_ADMIT = _lua(
    """
local id = ARGV[1]
local rpm, tpm = int_arg(2, -1, MAX_LIMIT_VALUE), int_arg(3, -1, MAX_LIMIT_VALUE)
local max_concurrent = int_arg(4, -1, MAX_LIMIT_VALUE)
local lease_ttl, reserve = int_arg(5, 1, MAX_LIMIT_VALUE), int_arg(6, 0, MAX_TOKENS_VALUE)
local queued = int_arg(7, 0, 1) == 1
local window, stale = int_arg(8, 1, MAX_LIMIT_VALUE), int_arg(9, 1, MAX_LIMIT_VALUE)
local concurrency_retry, queued_retry = int_arg(10, 0, MAX_LIMIT_VALUE), int_arg(11, 0, MAX_LIMIT_VALUE)
local max_waiters = int_arg(12, -1, MAX_LIMIT_VALUE)
local channel, tenant = ARGV[13], ARGV[14]
local sequences = int_arg(15, 1, MAX_LIMIT_VALUE)
local now = now_ms()

local function reset(key)
  local last = redis.call('ZRANGE', KEYS[key], -1, -1, 'WITHSCORES')
  if #last == 0 then return 0 end
  return math.max(0, tonumber(last[2]) + window - now)
end

local function total_tokens()
  return tonumber(redis.call('GET', KEYS[TOKENS_TOTAL]) or '0')
end

local function decide(admitted, reason, retry_after)
  keep_alive(window + lease_ttl)
  return {admitted, reason, math.max(0, retry_after), redis.call('ZCARD', KEYS[REQUESTS]), reset(REQUESTS),
          total_tokens(), reset(TOKENS_AT)}
end

-- LimiterState._token_wait: oldest reservations leave the window first; page through them.
local function token_wait(total, allowed)
  local start = 0
  while true do
    local page = redis.call('ZRANGE', KEYS[TOKENS_AT], start, start + 99, 'WITHSCORES')
    if #page == 0 then return window end
    local ids = {}
    for i = 1, #page, 2 do ids[#ids + 1] = page[i] end
    local amounts = redis.call('HMGET', KEYS[TOKENS_N], unpack(ids))
    for i = 1, #ids do
      total = total - (tonumber(amounts[i]) or 0)
      if total <= allowed then return math.max(1, tonumber(page[2 * i]) + window - now) end
    end
    start = start + 100
  end
end

-- LimiterState._expire
local horizon = now - window
redis.call('ZREMRANGEBYSCORE', KEYS[REQUESTS], '-inf', horizon)
local gone = redis.call('ZRANGEBYSCORE', KEYS[TOKENS_AT], '-inf', horizon)
if #gone > 0 then
  local sum = 0
  for i = 1, #gone, 1000 do
    local amounts = redis.call('HMGET', KEYS[TOKENS_N], unpack(gone, i, math.min(i + 999, #gone)))
    for j = 1, #amounts do sum = sum + (tonumber(amounts[j]) or 0) end
  end
  chunked('HDEL', KEYS[TOKENS_N], gone)
  redis.call('ZREMRANGEBYSCORE', KEYS[TOKENS_AT], '-inf', horizon)
  redis.call('DECRBY', KEYS[TOKENS_TOTAL], sum)
end
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[LEASES], '-inf', now)
if #lapsed > 0 then
  chunked('HDEL', KEYS[LEASES_N], lapsed)
  redis.call('ZREMRANGEBYSCORE', KEYS[LEASES], '-inf', now)
end
local stale_waiters = redis.call('ZRANGEBYSCORE', KEYS[QUEUE_SEEN], '-inf', now - stale)
if #stale_waiters > 0 then
  chunked('ZREM', KEYS[QUEUE], stale_waiters)
  chunked('ZREM', KEYS[QUEUE_SEEN], stale_waiters)
end

-- LimiterState._blocked: the first limit in the way, and when trying again can succeed; nil: it fits.
local function blocked()
  if rpm >= 0 and redis.call('ZCARD', KEYS[REQUESTS]) >= rpm then
    local oldest = redis.call('ZRANGE', KEYS[REQUESTS], 0, 0, 'WITHSCORES')
    local wait = window  -- rpm = 0: no request will ever leave the window to make room
    if #oldest > 0 then wait = tonumber(oldest[2]) + window - now end
    return 'requests', wait
  end
  local total = total_tokens()
  if tpm >= 0 and total + reserve > tpm then
    return 'tokens', token_wait(total, tpm - reserve)
  end
  local held = max_concurrent >= 0 and weight_of(redis.call('ZRANGE', KEYS[LEASES], 0, -1)) or 0
  if max_concurrent >= 0 and held + sequences > max_concurrent then
    return 'concurrency', concurrency_retry
  end
  return nil, 0
end

if tpm >= 0 and reserve > tpm then
  return decide(0, 'too_large', 0)
end
if max_concurrent >= 0 and sequences > max_concurrent then
  return decide(0, 'too_many_sequences', 0)
end
if queued then
  if not redis.call('ZSCORE', KEYS[QUEUE], id) then
    if max_waiters >= 0 and redis.call('ZCARD', KEYS[QUEUE]) >= max_waiters then
      local reason, wait = blocked()
      if not reason then wait = queued_retry end
      return decide(0, 'queue_full', wait)
    end
    -- Arrival order must be strict even for two arrivals in one ms (a ZSET breaks ties by member).
    local arrival = now
    local tail = redis.call('ZRANGE', KEYS[QUEUE], -1, -1, 'WITHSCORES')
    if #tail > 0 and tonumber(tail[2]) >= arrival then arrival = tonumber(tail[2]) + 1 end
    redis.call('ZADD', KEYS[QUEUE], arrival, id)
  end
  redis.call('ZADD', KEYS[QUEUE_SEEN], now, id)
  if redis.call('ZRANGE', KEYS[QUEUE], 0, 0)[1] ~= id then
    return decide(0, 'queued', queued_retry)
  end
end
local reason, wait = blocked()
if reason then
  return decide(0, reason, wait)
end
redis.call('ZREM', KEYS[QUEUE], id)
redis.call('ZREM', KEYS[QUEUE_SEEN], id)
redis.call('ZADD', KEYS[REQUESTS], now, id)
local previous = redis.call('HGET', KEYS[TOKENS_N], id)
if previous then  -- the same id admitted again: its reservation is replaced, not leaked
  redis.call('DECRBY', KEYS[TOKENS_TOTAL], previous)
end
redis.call('ZADD', KEYS[TOKENS_AT], now, id)
redis.call('HSET', KEYS[TOKENS_N], id, reserve)
redis.call('INCRBY', KEYS[TOKENS_TOTAL], reserve)
redis.call('ZADD', KEYS[LEASES], now + lease_ttl, id)
redis.call('HSET', KEYS[LEASES_N], id, sequences)
if queued then wake_waiters(channel, tenant) end  -- the head went: the next one may fit too
return decide(1, '', 0)
"""
)

# ARGV: request id, used tokens, wake channel, tenant. HSET and INCRBY keep the keys' expiry.
_RELEASE = _lua(
    """
local id, used = ARGV[1], int_arg(2, 0, MAX_TOKENS_VALUE)
local reserved = tonumber(redis.call('HGET', KEYS[TOKENS_N], id))
redis.call('ZREM', KEYS[LEASES], id)
redis.call('HDEL', KEYS[LEASES_N], id)
if reserved then  -- still in the window: the minute's total reflects what was really used
  redis.call('HSET', KEYS[TOKENS_N], id, used)
  redis.call('INCRBY', KEYS[TOKENS_TOTAL], used - reserved)
end
wake_waiters(ARGV[3], ARGV[4])
return 0
"""
)

# ARGV: request id, lease TTL, window. Like LimiterState.renew: no expiry pass, only a held lease moves.
_RENEW = _lua(
    """
local id, lease_ttl, window = ARGV[1], int_arg(2, 1, MAX_LIMIT_VALUE), int_arg(3, 1, MAX_LIMIT_VALUE)
if redis.call('ZSCORE', KEYS[LEASES], id) then
  redis.call('ZADD', KEYS[LEASES], now_ms() + lease_ttl, id)
  keep_alive(window + lease_ttl)
end
return 0
"""
)

# ARGV: request id, wake channel, tenant.
_LEAVE_QUEUE = _lua(
    """
if redis.call('ZREM', KEYS[QUEUE], ARGV[1]) == 1 then wake_waiters(ARGV[2], ARGV[3]) end
redis.call('ZREM', KEYS[QUEUE_SEEN], ARGV[1])
return 0
"""
)

# ARGV: window, queue stale (ms). Returns {requests, reset_requests, tokens, reset_tokens, leases, queued}.
# Read-only, unlike admit's expiry pass: it counts what that pass would keep, so a peek writes nothing.
_PEEK = _lua(
    """
local window, stale = int_arg(1, 1, MAX_LIMIT_VALUE), int_arg(2, 1, MAX_LIMIT_VALUE)
local now = now_ms()
local horizon = now - window

local function reset(key)
  local last = redis.call('ZRANGE', KEYS[key], -1, -1, 'WITHSCORES')
  if #last == 0 then return 0 end
  return math.max(0, tonumber(last[2]) + window - now)
end

local tokens = tonumber(redis.call('GET', KEYS[TOKENS_TOTAL]) or '0')
local gone = redis.call('ZRANGEBYSCORE', KEYS[TOKENS_AT], '-inf', horizon)
for i = 1, #gone, 1000 do
  local amounts = redis.call('HMGET', KEYS[TOKENS_N], unpack(gone, i, math.min(i + 999, #gone)))
  for j = 1, #amounts do tokens = tokens - (tonumber(amounts[j]) or 0) end
end
return {redis.call('ZCOUNT', KEYS[REQUESTS], '(' .. horizon, '+inf'), reset(REQUESTS), tokens,
        reset(TOKENS_AT), weight_of(redis.call('ZRANGEBYSCORE', KEYS[LEASES], '(' .. now, '+inf')),
        redis.call('ZCOUNT', KEYS[QUEUE_SEEN], '(' .. (now - stale), '+inf')}
"""
)


def _limit(value: int | None) -> int:
    return -1 if value is None else min(max(0, value), MAX_LIMIT)


class RedisLimiter(LimiterBackend):
    """`timeout_s` bounds every script call as a whole (waiting for a pooled connection, connecting, the
    script); past it, or on any connection error, the call raises LimiterUnavailable. It is a hang guard, not
    a latency target: a refused connection fails at once, and a busy ingress's event loop must not turn a
    burst into 503s (a 0.5 s budget did, on a loaded 2-core machine)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 3.0,
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
        self._admit = self._redis.register_script(_ADMIT)
        self._release = self._redis.register_script(_RELEASE)
        self._renew = self._redis.register_script(_RENEW)
        self._leave_queue = self._redis.register_script(_LEAVE_QUEUE)
        self._peek = self._redis.register_script(_PEEK)
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
            if _INVALID in str(error):  # refused before the script wrote anything
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
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
                    await client.aclose()
            await asyncio.sleep(LISTEN_RETRY_S)

    async def aclose(self) -> None:
        """Close the pool's connections and the listener (the limiter cannot be used afterwards)."""
        if self._listener is not None and not self._listener.done():
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._listener
        await self._redis.aclose()


def _nap_ms(decision: Decision) -> int:
    """How long a waiter sleeps before checking again, unless woken: until the window makes room for it,
    at most a heartbeat (which keeps its place, and notices leases that expired instead of being released)."""
    if decision.reason in ("requests", "tokens"):
        return max(1, min(HEARTBEAT_MS, decision.retry_after_ms))
    return HEARTBEAT_MS
