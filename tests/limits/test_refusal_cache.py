"""RefusalCache: which refusals are kept, for how long, aged how, and how many (issue 35, item 2)."""

import time

import pytest

from app.limits import Decision, Limits
from app.limits.refusal_cache import RefusalCache

RPM = Limits(rpm=3)


def refused(reason: str = "requests", retry_after_ms: int = 30_000) -> Decision:
    return Decision(False, reason, retry_after_ms, 3, 0, retry_after_ms, None, None, 0)  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(time, "monotonic", clock)
    return clock


def test_a_requests_refusal_is_kept_at_most_a_second_and_aged(clock: Clock) -> None:
    cache = RefusalCache()
    cache.remember("a", refused(), RPM)
    clock.now += 0.4
    kept = cache.refusal("a", RPM)
    assert kept is not None and kept.retry_after_ms == 29_600 and kept.reset_requests_ms == 29_600
    assert cache.refusal("b", RPM) is None  # another tenant
    clock.now += 0.6  # a second since: asked again, though the window is 29 s from freeing
    assert cache.refusal("a", RPM) is None and len(cache) == 0


def test_a_window_that_frees_sooner_than_the_hold_ends_the_refusal_then(clock: Clock) -> None:
    cache = RefusalCache()
    cache.remember("a", refused(retry_after_ms=200), RPM)
    clock.now += 0.15
    assert cache.refusal("a", RPM) is not None
    clock.now += 0.05
    assert cache.refusal("a", RPM) is None


def test_only_requests_refusals_of_reject_tiers_are_kept(clock: Clock) -> None:
    cache = RefusalCache()
    for reason in ("tokens", "concurrency", "queued", "queue_full", "too_large", "too_many_sequences"):
        cache.remember("a", refused(reason), RPM)
    cache.remember("a", refused(), Limits(rpm=3, on_limit="queue", max_queue_ms=1000))
    admitted = Decision(True, None, 0, 3, 2, 1000, None, None, 0)
    cache.remember("a", admitted, RPM)
    assert len(cache) == 0


def test_a_changed_tier_drops_the_refusal(clock: Clock) -> None:
    cache = RefusalCache()
    cache.remember("a", refused(), RPM)
    assert cache.refusal("a", Limits(rpm=100)) is None  # raised since: asks the limiter
    assert cache.refusal("a", RPM) is None


def test_bounded_oldest_first(clock: Clock) -> None:
    cache = RefusalCache(max_tenants=2)
    for tenant in ("a", "b", "c"):
        cache.remember(tenant, refused(), RPM)
    assert len(cache) == 2
    assert cache.refusal("a", RPM) is None
    assert cache.refusal("b", RPM) is not None and cache.refusal("c", RPM) is not None
