"""RedisBudgets: BudgetState's algorithm as Lua scripts in Redis (app/budgets/lua/*.lua), shared by every
ingress replica.

Each operation is one script, so it is atomic across replicas; amounts are integers (micro-units, below
2^53, where Lua's doubles are exact) and the clock is Redis's own. Keys, per tenant, share the hash tag
`{tenant}` (one cluster slot):

    meta       HASH  prepaid (0/1), balance, version, day, month, spent_day, spent_month, reserved,
                     limit_day, hard_day, limit_month, hard_month (a limit absent: none)
    holds      ZSET  request id -> expiry (ms)
    holds:n    HASH  request id -> amount held
    settled    ZSET  request id -> forget after (ms)
    credits    SET   credit versions counted above meta's `version` (they arrived before an earlier one)
    unseen     STRING the newest credit version noticed while the tenant was not loaded (expires after
                     UNSEEN_CREDIT_MS): a load with an older snapshot is refused

A tenant whose meta is missing (never loaded, or lost with a Redis restart) answers `not_loaded`: the
ingress loads it from the database before admitting anything, so an outage fails closed. Meta and
credits never expire on their own (a credit forgotten would be counted twice); the holds and settled ids
expire with the tenant's last activity plus their TTLs.
"""

from functools import cache
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from app.budgets.protocol import (
    SETTLED_MEMORY_MS,
    UNSEEN_CREDIT_MS,
    BudgetBackend,
    BudgetReason,
    BudgetView,
    Hold,
    Periods,
)
from app.limits import LimiterUnavailable
from billing.credit import BudgetSnapshot

_SUFFIXES = ("meta", "holds", "holds:n", "settled", "credits", "unseen")
_SCRIPTS = ("reserve", "settle", "load", "renew", "credit", "set_limits", "peek")


@cache
def budget_script(name: str) -> str:
    """Script `name` from app/budgets/lua (package data, read once): the prelude, then its body; `load`
    alone stands without the prelude."""
    lua = Path(__file__).with_name("lua")
    body = (lua / f"{name}.lua").read_text(encoding="utf-8")
    return body if name == "load" else (lua / "prelude.lua").read_text(encoding="utf-8") + body


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
    def __init__(self, url: str, *, timeout_s: float = 10.0, key_prefix: str = "loraplex:budget") -> None:
        if "{" in key_prefix or "}" in key_prefix:
            raise ValueError("key_prefix must not contain braces: the tenant is the keys' hash tag")
        self._prefix = key_prefix
        self._timeout = timeout_s
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=32, timeout=timeout_s, socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
        )  # fmt: skip
        self._redis = aioredis.Redis.from_pool(pool)
        self._scripts = {name: self._redis.register_script(budget_script(name)) for name in _SCRIPTS}

    def keys(self, tenant: str) -> list[str]:
        return [f"{self._prefix}:{{{tenant}}}:{suffix}" for suffix in _SUFFIXES]

    async def _run(self, name: str, tenant: str, args: list[int | str]) -> Any:
        for attempt in (1, 2):
            try:
                return await self._scripts[name](keys=self.keys(tenant), args=args)
            except RedisConnectionError as error:
                await self._redis.connection_pool.disconnect(inuse_connections=False)
                # Pooled connections that sat idle through a Redis restart are dead but look open: the
                # first request after the outage would fail on one. Once more, on a new connection; every
                # script is safe to replay (a hold replaces its request's, a settle is remembered, a credit
                # applies its version once, a load its version).
                if attempt == 2:
                    raise LimiterUnavailable(f"redis budgets unavailable: {error!r}") from error
            except (RedisError, OSError) as error:
                await self._redis.connection_pool.disconnect(inuse_connections=False)
                raise LimiterUnavailable(f"redis budgets unavailable: {error!r}") from error
        raise AssertionError("unreachable")

    async def load(self, snapshot: BudgetSnapshot, version: int) -> bool:
        fields: list[int | str] = [
            version, "prepaid", int(snapshot.balance is not None), "balance", snapshot.balance or 0,
            "version", version, "day", snapshot.day_key, "month", snapshot.month_key,
            "spent_day", snapshot.spent_day, "spent_month", snapshot.spent_month, "reserved", 0,
        ]  # fmt: skip
        for period, (amount, hard) in snapshot.limits.items():
            fields += [f"limit_{period}", amount, f"hard_{period}", int(hard)]
        return bool(await self._run("load", snapshot.tenant_id, fields))

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
        await self._run("credit", tenant, [delta, version, UNSEEN_CREDIT_MS])

    async def set_limits(self, tenant: str, limits: dict[str, tuple[int, bool]]) -> None:
        args: list[int | str] = []
        for period in ("day", "month"):
            amount, hard = limits.get(period, (-1, False))
            args += [amount, int(hard) if amount >= 0 else -1]
        await self._run("set_limits", tenant, args)

    async def forget(self, tenant: str) -> None:
        try:
            # `unseen` stays: a load in flight with an older snapshot is still refused.
            await self._redis.delete(*self.keys(tenant)[:-1])
        except (RedisError, OSError) as error:
            raise LimiterUnavailable(f"redis budgets unavailable: {error!r}") from error

    async def peek(self, tenant: str, periods: Periods) -> BudgetView | None:
        reply = await self._run("peek", tenant, [periods.day, periods.month])
        return None if not reply[0] else _view(reply[1:])

    async def aclose(self) -> None:
        await self._redis.aclose()
