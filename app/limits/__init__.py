"""Per-tenant rate limiting: the protocol the app depends on, and its three backends.

    protocol.py        Limits, Decision, WindowState, LimiterBackend (what app/ imports, through this face)
    state.py           LimiterState: the algorithm on in-memory state
    local_backend.py   LocalLimiter: LimiterState in this process (one ingress replica, tests)
    ray_backend.py     RayLimiter: LimiterState in one named Ray actor (the embedded default)
    redis_backend.py   RedisLimiter: the same algorithm as Lua scripts in Redis (production)
    factory.py         LimiterConfig (serve_config.yaml's `rate_limiter`) -> a backend

Only factory.py and the composition root (app/bootstrap.py, deployments/ingress.py) name a backend.
"""

from app.limits.protocol import (
    WINDOW_MS,
    Decision,
    LimiterBackend,
    LimiterUnavailable,
    Limits,
    Reason,
    WindowState,
    format_duration,
)

__all__ = [
    "WINDOW_MS",
    "Decision",
    "LimiterBackend",
    "LimiterUnavailable",
    "Limits",
    "Reason",
    "WindowState",
    "format_duration",
]
