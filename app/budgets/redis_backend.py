"""RedisBudgets: BudgetState's algorithm as Lua scripts in Redis, shared by every ingress replica.

Each operation is one script, so it is atomic across replicas; amounts are integers (micro-units, below
2^53, where Lua's doubles are exact) and the clock is Redis's own. Keys, per tenant, share the hash tag
`{tenant}` (one cluster slot):

    meta       HASH  prepaid (0/1), balance, version, day, month, spent_day, spent_month, reserved,
                     limit_day, hard_day, limit_month, hard_month (a limit absent: none)
    holds      ZSET  request id -> expiry (ms)
    holds:n    HASH  request id -> amount held
    settled    ZSET  request id -> forget after (ms)

A tenant whose meta is missing (never loaded, or lost with a Redis restart) answers `not_loaded`: the
ingress loads it from the database before admitting anything, so an outage fails closed. Meta never
expires on its own; the holds and settled ids expire with the tenant's last activity plus their TTLs.
"""

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from app.budgets.protocol import SETTLED_MEMORY_MS, BudgetBackend, BudgetReason, BudgetView, Hold, Periods
from app.limits import LimiterUnavailable
from billing.credit import BudgetSnapshot

_SUFFIXES = ("meta", "holds", "holds:n", "settled")

_PRELUDE = """
local META, HOLDS, HOLDS_N, SETTLED = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function num(field) return tonumber(redis.call('HGET', META, field) or '0') end
local function expire_holds(now)
  local lapsed = redis.call('ZRANGEBYSCORE', HOLDS, '-inf', now)
  for i = 1, #lapsed do
    local amount = tonumber(redis.call('HGET', HOLDS_N, lapsed[i]) or '0')
    redis.call('HINCRBY', META, 'reserved', -amount)
    redis.call('HDEL', HOLDS_N, lapsed[i])
  end
  if #lapsed > 0 then redis.call('ZREMRANGEBYSCORE', HOLDS, '-inf', now) end
end
-- A later period key (they sort by time) starts that period's spend at zero.
local function roll(day, month)
  if day > (redis.call('HGET', META, 'day') or '') then
    redis.call('HSET', META, 'day', day, 'spent_day', 0)
  end
  if month > (redis.call('HGET', META, 'month') or '') then
    redis.call('HSET', META, 'month', month, 'spent_month', 0)
  end
end
local function view()
  local f = redis.call('HMGET', META, 'prepaid', 'balance', 'reserved', 'spent_day', 'spent_month',
    'limit_day', 'hard_day', 'limit_month', 'hard_month')
  for i = 1, #f do f[i] = tonumber(f[i] or '-1') end
  return f
end
"""

# ARGV: request id, amount, ttl ms, day key, month key. Returns {admitted, reason, view...}.
_RESERVE = (
    _PRELUDE
    + """
if redis.call('EXISTS', META) == 0 then return {0, 'not_loaded'} end
local id, amount, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
expire_holds(now)
roll(ARGV[4], ARGV[5])
local previous = tonumber(redis.call('HGET', HOLDS_N, id) or '0')
local held = num('reserved') - previous
if num('prepaid') == 1 and num('balance') - held - amount < 0 then
  local v = view(); return {0, 'credit', unpack(v)}
end
local periods = {{'day', 'spent_day'}, {'month', 'spent_month'}}
for i = 1, 2 do
  local limit = redis.call('HGET', META, 'limit_' .. periods[i][1])
  local hard = num('hard_' .. periods[i][1]) == 1
  if limit and hard and tonumber(limit) - num(periods[i][2]) - held - amount < 0 then
    local v = view(); return {0, periods[i][1], unpack(v)}
  end
end
redis.call('ZADD', HOLDS, now + ttl, id)
redis.call('HSET', HOLDS_N, id, amount)
redis.call('HSET', META, 'reserved', held + amount)
local keep = ttl + 60000
for i = 2, 3 do
  if redis.call('PTTL', KEYS[i]) < keep then redis.call('PEXPIRE', KEYS[i], keep) end
end
local v = view(); return {1, '', unpack(v)}
"""
)

# ARGV: request id, cost, day key, month key, settled memory ms.
_SETTLE = (
    _PRELUDE
    + """
if redis.call('EXISTS', META) == 0 then return 0 end
local id, cost, memory = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[5])
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', SETTLED, '-inf', now)
if redis.call('ZSCORE', SETTLED, id) then return 0 end
roll(ARGV[3], ARGV[4])
local amount = redis.call('HGET', HOLDS_N, id)
if amount then
  redis.call('HINCRBY', META, 'reserved', -tonumber(amount))
  redis.call('HDEL', HOLDS_N, id)
  redis.call('ZREM', HOLDS, id)
end
if num('prepaid') == 1 then redis.call('HINCRBY', META, 'balance', -cost) end
redis.call('HINCRBY', META, 'spent_day', cost)
redis.call('HINCRBY', META, 'spent_month', cost)
redis.call('ZADD', SETTLED, now + memory, id)
if redis.call('PTTL', SETTLED) < memory then redis.call('PEXPIRE', SETTLED, memory) end
return 1
"""
)

# ARGV: fields and values of a snapshot (HSET pairs). Only when not loaded.
_LOAD = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

# ARGV: request id, ttl ms.
_RENEW = (
    _PRELUDE
    + """
if redis.call('ZSCORE', HOLDS, ARGV[1]) then
  redis.call('ZADD', HOLDS, now_ms() + tonumber(ARGV[2]), ARGV[1])
  local keep = tonumber(ARGV[2]) + 60000
  for i = 2, 3 do
    if redis.call('PTTL', KEYS[i]) < keep then redis.call('PEXPIRE', KEYS[i], keep) end
  end
end
return 0
"""
)

# ARGV: delta, version.
_CREDIT = (
    _PRELUDE
    + """
if redis.call('EXISTS', META) == 0 or tonumber(ARGV[2]) <= num('version') then return 0 end
if num('prepaid') == 0 then redis.call('DEL', META); return 0 end
redis.call('HINCRBY', META, 'balance', tonumber(ARGV[1]))
redis.call('HSET', META, 'version', ARGV[2])
return 1
"""
)

# ARGV: limit_day, hard_day, limit_month, hard_month (-1: none).
_SET_LIMITS = (
    _PRELUDE
    + """
if redis.call('EXISTS', META) == 0 then return 0 end
local names = {'limit_day', 'hard_day', 'limit_month', 'hard_month'}
for i = 1, 4 do
  if tonumber(ARGV[i]) < 0 then
    redis.call('HDEL', META, names[i])
  else
    redis.call('HSET', META, names[i], ARGV[i])
  end
end
return 1
"""
)

# ARGV: day key, month key. Read-only: counts the holds that have not expired.
_PEEK = (
    _PRELUDE
    + """
if redis.call('EXISTS', META) == 0 then return {0} end
local live = redis.call('ZRANGEBYSCORE', HOLDS, '(' .. now_ms(), '+inf')
local reserved = 0
for i = 1, #live do reserved = reserved + tonumber(redis.call('HGET', HOLDS_N, live[i]) or '0') end
local v = view()
v[3] = reserved
if (redis.call('HGET', META, 'day') or '') ~= ARGV[1] then v[4] = 0 end
if (redis.call('HGET', META, 'month') or '') ~= ARGV[2] then v[5] = 0 end
return {1, unpack(v)}
"""
)

_REASONS: dict[bytes, BudgetReason] = {b"credit": "credit", b"day": "day", b"month": "month",
                                       b"not_loaded": "not_loaded"}  # fmt: skip


def _view(fields: list[Any]) -> BudgetView:
    prepaid, balance, reserved, spent_day, spent_month, limit_day, hard_day, limit_month, hard_month = (
        int(v) for v in fields
    )
    limits = {}
    if limit_day >= 0:
        limits["day"] = (limit_day, hard_day == 1)
    if limit_month >= 0:
        limits["month"] = (limit_month, hard_month == 1)
    return BudgetView(
        balance=balance if prepaid == 1 else None,
        reserved=reserved,
        spent_day=spent_day,
        spent_month=spent_month,
        limits=limits,
    )


class RedisBudgets(BudgetBackend):
    def __init__(self, url: str, *, timeout_s: float = 3.0, key_prefix: str = "loraplex:budget") -> None:
        if "{" in key_prefix or "}" in key_prefix:
            raise ValueError("key_prefix must not contain braces: the tenant is the keys' hash tag")
        self._prefix = key_prefix
        self._timeout = timeout_s
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=32, timeout=timeout_s, socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
        )  # fmt: skip
        self._redis = aioredis.Redis.from_pool(pool)
        self._scripts = {
            name: self._redis.register_script(body)
            for name, body in (("reserve", _RESERVE), ("settle", _SETTLE), ("load", _LOAD), ("renew", _RENEW),
                               ("credit", _CREDIT), ("set_limits", _SET_LIMITS), ("peek", _PEEK))
        }  # fmt: skip

    def keys(self, tenant: str) -> list[str]:
        return [f"{self._prefix}:{{{tenant}}}:{suffix}" for suffix in _SUFFIXES]

    async def _run(self, name: str, tenant: str, args: list[int | str]) -> Any:
        try:
            return await self._scripts[name](keys=self.keys(tenant), args=args)
        except (RedisError, OSError) as error:
            await self._redis.connection_pool.disconnect(inuse_connections=False)
            raise LimiterUnavailable(f"redis budgets unavailable: {error!r}") from error

    async def load(self, snapshot: BudgetSnapshot, version: int) -> None:
        fields: list[int | str] = [
            "prepaid", int(snapshot.balance is not None), "balance", snapshot.balance or 0,
            "version", version, "day", snapshot.day_key, "month", snapshot.month_key,
            "spent_day", snapshot.spent_day, "spent_month", snapshot.spent_month, "reserved", 0,
        ]  # fmt: skip
        for period, (amount, hard) in snapshot.limits.items():
            fields += [f"limit_{period}", amount, f"hard_{period}", int(hard)]
        await self._run("load", snapshot.tenant_id, fields)

    async def reserve(self, tenant: str, request_id: str, amount: int, ttl_ms: int, periods: Periods) -> Hold:
        if amount < 0:
            raise ValueError(f"a reservation must not be negative, got {amount}")
        reply = await self._run("reserve", tenant, [request_id, amount, ttl_ms, periods.day, periods.month])
        admitted, reason = bool(reply[0]), reply[1]
        if reason == b"not_loaded":
            return Hold(False, "not_loaded", None)
        return Hold(admitted, None if admitted else _REASONS[reason], _view(reply[2:]))

    async def settle(self, tenant: str, request_id: str, cost: int, periods: Periods) -> None:
        if cost < 0:
            raise ValueError(f"a cost must not be negative, got {cost}")
        await self._run("settle", tenant, [request_id, cost, periods.day, periods.month, SETTLED_MEMORY_MS])

    async def renew(self, tenant: str, request_id: str, ttl_ms: int) -> None:
        await self._run("renew", tenant, [request_id, ttl_ms])

    async def credit(self, tenant: str, delta: int, version: int) -> None:
        await self._run("credit", tenant, [delta, version])

    async def set_limits(self, tenant: str, limits: dict[str, tuple[int, bool]]) -> None:
        args: list[int | str] = []
        for period in ("day", "month"):
            amount, hard = limits.get(period, (-1, False))
            args += [amount, int(hard) if amount >= 0 else -1]
        await self._run("set_limits", tenant, args)

    async def forget(self, tenant: str) -> None:
        try:
            await self._redis.delete(*self.keys(tenant))
        except (RedisError, OSError) as error:
            raise LimiterUnavailable(f"redis budgets unavailable: {error!r}") from error

    async def peek(self, tenant: str, periods: Periods) -> BudgetView | None:
        reply = await self._run("peek", tenant, [periods.day, periods.month])
        return None if not reply[0] else _view(reply[1:])

    async def aclose(self) -> None:
        await self._redis.aclose()
