"""Per-tenant rate limiting: the protocol the app depends on, and its three backends.

    protocol.py        Limits, Decision, WindowState, LimiterBackend (what app/ imports, through this face)
    state.py           LimiterState: the algorithm on in-memory state
    waiting_state.py   WaitingState: LimiterState plus waiters that sleep until woken (local and Ray)
    wakeups.py         Wakeups: sleeping waiters per tenant, woken in queue order from any thread
    peek_cache.py      PeekCache: peeks shared for a moment, so reads cannot flood the limiter
    refusal_cache.py   RefusalCache: an RPM refusal kept for a moment, so a refused flood is not parsed
    local_backend.py   LocalLimiter: LimiterState in this process (one ingress replica, tests)
    ray_backend.py     RayLimiter: LimiterState in one named Ray actor (the embedded default)
    redis_backend.py   RedisLimiter: the same algorithm as Lua scripts in Redis (production)
    lua_scripts.py     the Redis scripts, read once from lua/*.lua (package data)
    factory.py         LimiterConfig (serve_config.yaml's `rate_limiter`) -> a backend

Only factory.py and the composition root (app/bootstrap.py, deployments/ingress.py) name a backend.
"""

from app.limits.protocol import (
    MAX_TOKENS,
    WINDOW_MS,
    Decision,
    InvalidTokenCount,
    LimiterBackend,
    LimiterUnavailable,
    Limits,
    Reason,
    WindowState,
    format_duration,
)

__all__ = [
    "MAX_TOKENS",
    "WINDOW_MS",
    "Decision",
    "InvalidTokenCount",
    "LimiterBackend",
    "LimiterUnavailable",
    "Limits",
    "Reason",
    "WindowState",
    "format_duration",
]
