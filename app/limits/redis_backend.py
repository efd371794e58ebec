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
    queue         ZSET  request id -> arrival (ms)      FIFO order
    queue:seen    ZSET  request id -> last poll (ms)    a ZSET, not a HASH: stale waiters are a range query

Every key gets the same expiry, pushed to at least window + lease TTL on each admit and renew: an idle
tenant leaves nothing behind, and keys that must agree (the token ZSET, hash and total) vanish together.
"""

import asyncio
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from app.limits.protocol import (
    WINDOW_MS,
    Decision,
    LimiterBackend,
    LimiterUnavailable,
    Limits,
    Reason,
    WindowState,
)
from app.limits.state import CONCURRENCY_RETRY_MS, QUEUE_STALE_MS

QUEUED_RETRY_MS = 50  # LimiterState's literal for a waiter that is not at the head of the queue
_KEY_SUFFIXES = ("requests", "tokens:at", "tokens:n", "tokens:total", "leases", "queue", "queue:seen")
_REASONS: dict[bytes, Reason] = {
    b"requests": "requests",
    b"tokens": "tokens",
    b"concurrency": "concurrency",
    b"queued": "queued",
    b"too_large": "too_large",
}

# Shared by every script. Lua 5.1's unpack() overflows the C stack past ~8000 values: big batches go in
# chunks. Server time, in ms: the one clock every replica agrees on.
_PRELUDE = """
local REQUESTS, TOKENS_AT, TOKENS_N, TOKENS_TOTAL, LEASES, QUEUE, QUEUE_SEEN = 1, 2, 3, 4, 5, 6, 7

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
"""

# ARGV: request id, rpm, tpm, max_concurrent (-1: unlimited), lease TTL, reserve, queued (0/1),
# window, queue stale, concurrency retry, queued retry (all ms).
# Returns {admitted, reason, retry_after, requests in window, reset_requests, token total, reset_tokens}.
_ADMIT = (
    _PRELUDE
    + """
local id = ARGV[1]
local rpm, tpm, max_concurrent = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local lease_ttl, reserve, queued = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7] == '1'
local window, stale = tonumber(ARGV[8]), tonumber(ARGV[9])
local concurrency_retry, queued_retry = tonumber(ARGV[10]), tonumber(ARGV[11])
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
redis.call('ZREMRANGEBYSCORE', KEYS[LEASES], '-inf', now)
local stale_waiters = redis.call('ZRANGEBYSCORE', KEYS[QUEUE_SEEN], '-inf', now - stale)
if #stale_waiters > 0 then
  chunked('ZREM', KEYS[QUEUE], stale_waiters)
  chunked('ZREM', KEYS[QUEUE_SEEN], stale_waiters)
end

if tpm >= 0 and reserve > tpm then
  return decide(0, 'too_large', 0)
end
if queued then
  if not redis.call('ZSCORE', KEYS[QUEUE], id) then
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
if rpm >= 0 and redis.call('ZCARD', KEYS[REQUESTS]) >= rpm then
  local oldest = redis.call('ZRANGE', KEYS[REQUESTS], 0, 0, 'WITHSCORES')
  local wait = window  -- rpm = 0: no request will ever leave the window to make room
  if #oldest > 0 then wait = tonumber(oldest[2]) + window - now end
  return decide(0, 'requests', wait)
end
local total = total_tokens()
if tpm >= 0 and total + reserve > tpm then
  return decide(0, 'tokens', token_wait(total, tpm - reserve))
end
if max_concurrent >= 0 and redis.call('ZCARD', KEYS[LEASES]) >= max_concurrent then
  return decide(0, 'concurrency', concurrency_retry)
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
return decide(1, '', 0)
"""
)

# ARGV: request id, used tokens. HSET and INCRBY keep the keys' expiry.
_RELEASE = (
    _PRELUDE
    + """
local id, used = ARGV[1], tonumber(ARGV[2])
redis.call('ZREM', KEYS[LEASES], id)
local reserved = redis.call('HGET', KEYS[TOKENS_N], id)
if reserved then  -- still in the window: the minute's total reflects what was really used
  redis.call('HSET', KEYS[TOKENS_N], id, used)
  redis.call('INCRBY', KEYS[TOKENS_TOTAL], used - tonumber(reserved))
end
return 0
"""
)

# ARGV: request id, lease TTL, window. Like LimiterState.renew: no expiry pass, only a held lease moves.
_RENEW = (
    _PRELUDE
    + """
local id, lease_ttl, window = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
if redis.call('ZSCORE', KEYS[LEASES], id) then
  redis.call('ZADD', KEYS[LEASES], now_ms() + lease_ttl, id)
  keep_alive(window + lease_ttl)
end
return 0
"""
)

# ARGV: request id.
_LEAVE_QUEUE = (
    _PRELUDE
    + """
redis.call('ZREM', KEYS[QUEUE], ARGV[1])
redis.call('ZREM', KEYS[QUEUE_SEEN], ARGV[1])
return 0
"""
)

# ARGV: window, queue stale (ms). Returns {requests, reset_requests, tokens, reset_tokens, leases, queued}.
# Read-only, unlike admit's expiry pass: it counts what that pass would keep, so a peek writes nothing.
_PEEK = (
    _PRELUDE
    + """
local window, stale = tonumber(ARGV[1]), tonumber(ARGV[2])
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
        reset(TOKENS_AT), redis.call('ZCOUNT', KEYS[LEASES], '(' .. now, '+inf'),
        redis.call('ZCOUNT', KEYS[QUEUE_SEEN], '(' .. (now - stale), '+inf')}
"""
)


def _limit(value: int | None) -> int:
    return -1 if value is None else value


class RedisLimiter(LimiterBackend):
    """`timeout_s` bounds every call as a whole (waiting for a pooled connection, connecting, the script);
    past it, or on any Redis error, the call raises LimiterUnavailable."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 0.5,
        key_prefix: str = "loraplex:rl",
        max_connections: int = 32,
    ) -> None:
        if "{" in key_prefix or "}" in key_prefix:
            raise ValueError("key_prefix must not contain braces: the tenant is the keys' hash tag")
        self._timeout = timeout_s
        self._prefix = key_prefix
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
        except (RedisError, TimeoutError, OSError) as error:
            if not isinstance(error, ResponseError):  # the connection, not the script: drop idle sockets
                # Connections that sat idle through an outage are dead but look open; without this, each
                # fails once on its next use, long after Redis came back.
                await self._redis.connection_pool.disconnect(inuse_connections=False)
            raise LimiterUnavailable(f"redis rate limiter unavailable: {error!r}") from error

    async def admit(
        self, tenant: str, request_id: str, limits: Limits, reserve_tokens: int, *, queued: bool
    ) -> Decision:
        args: list[int | str] = [
            request_id,
            _limit(limits.rpm),
            _limit(limits.tpm),
            _limit(limits.max_concurrent),
            limits.lease_ttl_ms,
            reserve_tokens,
            int(queued),
            WINDOW_MS,
            QUEUE_STALE_MS,
            CONCURRENCY_RETRY_MS,
            QUEUED_RETRY_MS,
        ]
        reply = await self._run(self._admit, tenant, args)
        admitted, reason, retry_after, requests, reset_requests, tokens, reset_tokens = reply
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
        await self._run(self._release, tenant, [request_id, used_tokens])

    async def renew(self, tenant: str, request_id: str, limits: Limits) -> None:
        await self._run(self._renew, tenant, [request_id, limits.lease_ttl_ms, WINDOW_MS])

    async def leave_queue(self, tenant: str, request_id: str) -> None:
        await self._run(self._leave_queue, tenant, [request_id])

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

    async def aclose(self) -> None:
        """Close the pool's connections (the limiter cannot be used afterwards)."""
        await self._redis.aclose()
