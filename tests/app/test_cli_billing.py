"""`loraplex billing` against a temporary SQLite database and the Stripe stub, configured by environment."""

import itertools
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy import select
from typer.testing import CliRunner, Result

from app.cli import build_app
from bench.stripe_stub import EVENT_NAMES, StripeStub
from billing.db import make_engine, make_session_factory, session_scope
from billing.migrate import upgrade
from billing.models import Tenant, UsageEvent
from billing.usage import UsageRecord, hour_of, record_usage
from tests.app.helpers import as_json

_ids = itertools.count()


def record(tenant: str, started_at: datetime, tokens: int) -> UsageRecord:
    return UsageRecord(
        request_id=f"cli-{next(_ids)}", tenant_id=tenant, key_id="key_x", model="tiny", base_model="tiny",
        adapter_id=None, adapter_version=None, status="completed", finish_reason="stop", prompt_tokens=tokens,
        cached_tokens=tokens // 4, completion_tokens=tokens // 2, gpu_ms=tokens * 1.5, queue_ms=0.0,
        ttft_ms=1.0, latency_ms=2.0, replica="r0", started_at=started_at, finished_at=started_at,
        cost="0", currency="usd",  # the free tier's prices are 0
    )  # fmt: skip


@pytest.fixture
def stub() -> Iterator[StripeStub]:
    with StripeStub() as running:
        yield running


@pytest.fixture
def database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stub: StripeStub) -> str:
    """A migrated SQLite file with two billed tenants' usage in three closed hours; Stripe is the stub."""
    url = f"sqlite:///{tmp_path / 'billing.db'}"
    upgrade(url)
    engine = make_engine(url)
    now = hour_of(datetime.now(UTC))
    with session_scope(make_session_factory(engine)) as s:
        s.add_all([Tenant(id="ten_a", name="a", tier="free", stripe_customer_id="cus_a"),
                   Tenant(id="ten_b", name="b", tier="free", stripe_customer_id="cus_b")])  # fmt: skip
        record_usage(s, [record(t, now - timedelta(hours=h, minutes=-20), 100 * h) for t in ("ten_a", "ten_b")
                         for h in (2, 3, 4)])  # fmt: skip
    engine.dispose()
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", url)
    monkeypatch.setenv("LORAPLEX_STRIPE_API_KEY", stub.api_key)
    monkeypatch.setenv("LORAPLEX_STRIPE_API_BASE", stub.url)
    monkeypatch.setenv("LORAPLEX_STRIPE_MAX_NETWORK_RETRIES", "0")
    return url


def cli(*args: str) -> Result:
    return CliRunner().invoke(build_app(), list(args))


def window() -> tuple[str, str]:
    now = hour_of(datetime.now(UTC))
    return (now - timedelta(hours=12)).isoformat(), now.strftime("%Y-%m-%dT%H:%MZ")


def test_rollup_export_and_reconcile(database: str, stub: StripeStub) -> None:
    rolled = as_json(cli("--json", "billing", "rollup", "--hours", "6"))
    assert rolled["rollups"] == 6

    exported = as_json(cli("--json", "billing", "export"))
    assert (exported["sent"], exported["failed"], exported["pending"]) == (24, 0, 0)
    assert stub.totals()["cus_a", EVENT_NAMES[2]] == 50 * (2 + 3 + 4)  # output: tokens // 2 per hour

    again = cli("billing", "export")
    assert again.exit_code == 0, again.output
    assert "0 sent" in again.stdout and "0 failed" in again.stdout

    start, end = window()
    clean = as_json(cli("--json", "billing", "reconcile", "--start", start, "--end", end))
    assert clean["discrepancies"] == [] and clean["stripe_checked"] is True
    assert "No discrepancies" in cli("billing", "reconcile", "--start", start, "--end", end).stdout

    stub.tamper("cus_b", EVENT_NAMES[0], 5, int(stub.events[0].timestamp))
    found = cli("billing", "reconcile", "--start", start, "--end", end)
    assert found.exit_code == 1
    assert "1 discrepancy for" in found.stdout
    assert "cus_b" in found.stdout and EVENT_NAMES[0] in found.stdout
    without_stripe = as_json(
        cli("--json", "billing", "reconcile", "--start", start, "--end", end, "--no-stripe")
    )
    assert without_stripe == {**clean, "stripe_checked": False}


def test_reconcile_checks_settled_spend_against_the_price_history(database: str) -> None:
    """Each usage row's settled cost against the price book, per tenant and UTC day, to the cent."""
    start, end = window()
    clean = as_json(cli("--json", "billing", "reconcile", "--start", start, "--end", end, "--no-stripe"))
    assert clean["spend_discrepancies"] == []
    engine = make_engine(database)
    with session_scope(make_session_factory(engine)) as s:
        row = s.scalars(select(UsageEvent).where(UsageEvent.tenant_id == "ten_b").limit(1)).one()
        row.cost = Decimal("0.02")  # settled at a price the history never had
        s.add(UsageEvent(**{**{c.name: getattr(row, c.name) for c in UsageEvent.__table__.columns},
                            "request_id": "unsettled", "cost": None}))  # fmt: skip
    engine.dispose()
    found = as_json(cli("--json", "billing", "reconcile", "--start", start, "--end", end, "--no-stripe"), 1)
    (d,) = found["spend_discrepancies"]
    assert (d["tenant_id"], d["settled"], d["repriced"], d["unpriced"]) == (
        "ten_b",
        "0.020000",
        "0.000000",
        0,  # the row settled without a cost is billed from the price history: not a discrepancy
    )
    human = cli("billing", "reconcile", "--start", start, "--end", end, "--no-stripe")
    assert human.exit_code == 1 and "1 spend discrepancies" in human.stdout and "ten_b" in human.stdout


def test_export_exits_1_when_events_stay_pending(
    database: str, stub: StripeStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAPLEX_STRIPE_API_KEY", "sk_test_revoked")
    assert cli("billing", "rollup").exit_code == 0

    result = cli("--json", "billing", "export")

    summary = as_json(result, code=1)
    assert (summary["sent"], summary["failed"], summary["pending"]) == (0, 1, 24)
    human = cli("billing", "export")
    assert human.exit_code == 1
    assert "1 failed" in human.stdout and "retried by the next run" in human.stdout


def test_export_without_a_key_is_refused(database: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_STRIPE_API_KEY", "")
    result = cli("billing", "export")
    assert result.exit_code == 2
    assert "disabled" in result.stderr and "LORAPLEX_STRIPE_API_KEY" in result.stderr


def test_bad_options_and_settings_exit_2(database: str, monkeypatch: pytest.MonkeyPatch) -> None:
    start, end = window()
    off_hour = cli("billing", "reconcile", "--start", "2025-11-01T10:30", "--end", end)
    assert off_hour.exit_code == 2 and "whole hour" in off_hour.stderr
    assert cli("billing", "reconcile", "--start", "yesterday", "--end", end).exit_code == 2
    backwards = cli("billing", "reconcile", "--start", end, "--end", start)
    assert backwards.exit_code == 2 and "after --start" in backwards.stderr

    monkeypatch.setenv("LORAPLEX_STRIPE_BATCH_LIMIT", "0")
    invalid = cli("billing", "export")
    assert invalid.exit_code == 2 and "LORAPLEX_STRIPE_" in invalid.stderr
    assert "Traceback" not in invalid.output


def test_a_missing_database_file_is_not_created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nope.db"
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", f"sqlite:///{missing}")
    result = cli("billing", "rollup")
    assert result.exit_code == 2
    assert "does not exist" in result.stderr and "loraplex db upgrade" in result.stderr
    assert not missing.exists()
