"""The Metering deployment's own periodic job, as its thread runs it: usage of closed hours is rolled up
and exported to Stripe without anyone calling the CLI, on SQLite and PostgreSQL."""

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
import stripe
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from bench.stripe_stub import StripeStub
from billing.db import session_scope
from billing.models import Tenant, UsageRollup
from billing.usage import hour_of, record_usage
from deployments.metering import Metering
from tests.billing.test_stripe_export import METER, usage


def _until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the periodic job did not get there in time"
        time.sleep(0.05)


def test_the_periodic_job_rolls_up_and_exports_by_itself(
    session_factory: sessionmaker[Session], database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stripe.HTTPClient, "INITIAL_DELAY", 0.001)
    two_hours_ago = hour_of(datetime.now(UTC)) - timedelta(hours=2)
    with session_scope(session_factory) as session:
        session.add(Tenant(id="ten_meter", name="meter", tier="free", stripe_customer_id="cus_meter"))
        record_usage(session, [usage("ten_meter", two_hours_ago + timedelta(minutes=m), 40, 10, 5, 12.0)
                               for m in (1, 20, 50)])  # fmt: skip
    with StripeStub() as stub:
        monkeypatch.setenv("LORAPLEX_DATABASE_URL", database_url)
        monkeypatch.setenv("LORAPLEX_STRIPE_API_KEY", stub.api_key)
        monkeypatch.setenv("LORAPLEX_STRIPE_API_BASE", stub.url)
        metering = Metering(rollup_interval_s=0.1)  # as Serve constructs it; its thread starts at once
        try:
            _until(lambda: bool(stub.totals()))
            _until(lambda: stub.totals() == {
                ("cus_meter", METER["input_tokens"]): 90,
                ("cus_meter", METER["cached_input_tokens"]): 30,
                ("cus_meter", METER["output_tokens"]): 15,
                ("cus_meter", METER["gpu_ms"]): 36,
            })  # fmt: skip
        finally:
            metering.stop()
    with session_factory() as session:
        (rollup,) = session.scalars(select(UsageRollup).where(UsageRollup.tenant_id == "ten_meter"))
    assert rollup.hour == two_hours_ago and (rollup.prompt_tokens, rollup.completion_tokens) == (120, 15)
