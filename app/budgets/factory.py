"""The budget backend beside the rate limiter: the same kind as `rate_limiter.backend` names (a Ray actor
or Redis), so money is shared by every ingress replica exactly as the rate limits are."""

from app.budgets.protocol import BudgetBackend
from app.limits.factory import LimiterConfig


def make_budgets(config: LimiterConfig) -> BudgetBackend:
    """Each backend imported only when chosen, as make_limiter does."""
    if config.backend == "redis":
        from app.budgets.redis_backend import RedisBudgets

        assert config.redis_url is not None  # LimiterConfig's validator saw to it
        return RedisBudgets(config.redis_url, timeout_s=config.timeout_s)
    from app.budgets.ray_backend import RayBudgets

    return RayBudgets(timeout_s=config.timeout_s)
