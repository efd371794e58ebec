"""Fixtures of the Stripe export tests: the Stripe stub, a real clock, and quick SDK retries."""

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
import stripe

from bench.stripe_stub import StripeStub


@pytest.fixture(autouse=True)
def _quick_sdk_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    # The SDK sleeps at least 0.5 s between its own retries; the behaviour under test is the same faster.
    monkeypatch.setattr(stripe.HTTPClient, "INITIAL_DELAY", 0.001)
    monkeypatch.setattr(stripe.HTTPClient, "MAX_DELAY", 0.005)
    for name in ("API_KEY", "API_BASE", "METER_INPUT_TOKENS", "METER_GPU_MS", "BATCH_LIMIT"):
        monkeypatch.delenv(f"LORAPLEX_STRIPE_{name}", raising=False)


@pytest.fixture
def stub() -> Iterator[StripeStub]:
    with StripeStub() as running:
        yield running


@pytest.fixture
def now() -> datetime:
    return datetime.now(UTC)
