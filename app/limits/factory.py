"""LimiterConfig, serve_config.yaml's `rate_limiter:` section, and the backend it names."""

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.limits.protocol import DEFAULT_MAX_WAITERS, LimiterBackend


class LimiterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    backend: Literal["ray", "redis"] = Field(
        default="ray", description="ray: one actor in this cluster (no other service); redis: production."
    )
    redis_url: str | None = Field(
        default_factory=lambda: os.environ.get("LORAPLEX_REDIS_URL") or None,
        description="redis://host:port/db, for backend redis; unset: LORAPLEX_REDIS_URL from the environment",
    )
    fail_open: bool = Field(
        default=False, description="Admit requests when the limiter is unreachable (default: answer 503)."
    )
    timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="How long one limiter call may take before the limiter counts as unreachable (a "
        "queued admit gets its queue wait on top). A hang guard: a refused connection fails at once.",
    )
    max_waiters_per_tenant: int = Field(
        default=DEFAULT_MAX_WAITERS,
        ge=0,
        description="Requests of one tenant that may wait in an on_limit: queue tier's queue at once; "
        "more are refused with a 429 at once, so one tenant's flood cannot tie up the limiter.",
    )

    @model_validator(mode="after")
    def _redis_needs_url(self) -> "LimiterConfig":
        if self.backend == "redis" and not self.redis_url:
            raise ValueError(
                "rate_limiter.backend redis needs rate_limiter.redis_url (or LORAPLEX_REDIS_URL)"
            )
        return self


def make_limiter(config: LimiterConfig) -> LimiterBackend:
    """The cluster-wide limiter every ingress replica shares (each backend imported only when chosen)."""
    if config.backend == "redis":
        from app.limits.redis_backend import RedisLimiter

        assert config.redis_url is not None  # the validator saw to it
        return RedisLimiter(
            config.redis_url, timeout_s=config.timeout_s, max_waiters_per_tenant=config.max_waiters_per_tenant
        )
    from app.limits.ray_backend import RayLimiter

    return RayLimiter(timeout_s=config.timeout_s, max_waiters_per_tenant=config.max_waiters_per_tenant)
