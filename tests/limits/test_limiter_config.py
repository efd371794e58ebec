"""serve_config.yaml's `rate_limiter:` section: the Redis URL may come from the environment (clusters set
one LORAPLEX_REDIS_URL on every node), and a Redis backend without any URL is refused up front."""

import pytest
from pydantic import ValidationError

from app.limits.factory import LimiterConfig


def test_the_redis_url_falls_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_REDIS_URL", "redis://cache.internal:6379/2")
    assert LimiterConfig(backend="redis").redis_url == "redis://cache.internal:6379/2"
    written = LimiterConfig(backend="redis", redis_url="redis://other:6379/0")
    assert written.redis_url == "redis://other:6379/0"  # the config's own wins


def test_redis_without_a_url_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAPLEX_REDIS_URL", raising=False)
    with pytest.raises(ValidationError, match="LORAPLEX_REDIS_URL"):
        LimiterConfig(backend="redis")
    assert LimiterConfig().redis_url is None
