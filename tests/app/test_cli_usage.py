"""`loraplex usage show|bill`, tier prices (`tiers --price-*`) and `tenants update --stripe-customer`,
against the live app."""

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from typer.testing import Result

from billing.models import Adapter
from billing.usage import rollup_hours
from tests.app.conftest import MODEL, Served
from tests.app.helpers import as_json, unique
from tests.billing.test_usage_queries import make_event

Cli = Callable[..., Result]
T0 = datetime(2025, 5, 1, 10, 0, tzinfo=UTC)
PERIOD = ("--start", "2025-05-01T10:00:00Z", "--end", "2025-05-01T12:00:00Z")


@pytest.fixture(scope="module")
def usage_world(served: Served) -> dict[str, str]:
    """Tenants a (on a priced tier, with an adapter) and b, with usage over two hours, rolled up."""
    with served.admin() as admin:
        tier = admin.post(
            "/admin/tiers",
            json={
                "name": unique("cli-metered"),
                "price_input_per_mtok": "0.15",
                "price_output_per_mtok": "0.6",
            },
        ).json()
    a, _ = served.new_tenant(unique("cli-a"), tier=tier["name"])
    b, _ = served.new_tenant(unique("cli-b"))
    with served.services.session_factory() as s, s.begin():
        adapter = Adapter(name="support", owner=a, base_model=MODEL)
        s.add(adapter)
        s.flush()
        s.add_all(
            [
                make_event(a, T0, prompt_tokens=1_234_567, cached_tokens=0, completion_tokens=0, gpu_ms=0.0),
                make_event(a, T0 + timedelta(hours=1), adapter_id=adapter.id, prompt_tokens=0,
                           completion_tokens=1_000_000, gpu_ms=1500.0),
                make_event(b, T0, prompt_tokens=5),
            ]
        )  # fmt: skip
        s.flush()
        rollup_hours(s, start=T0, end=T0 + timedelta(hours=2))
    return {"a": a, "b": b, "adapter": adapter.id, "tier": tier["name"]}


def test_usage_show_json_is_the_apis(cli: Cli, usage_world: dict[str, str]) -> None:
    listing = as_json(
        cli("--json", "usage", "show", "--tenant", usage_world["a"], *PERIOD, "--group-by", "adapter")
    )
    assert (listing["object"], listing["group_by"]) == ("list", "adapter")
    assert [
        (d["adapter"], d["requests"], d["prompt_tokens"], d["completion_tokens"]) for d in listing["data"]
    ] == [
        ("base", 1, 1_234_567, 0),
        ("support", 1, 0, 1_000_000),
    ]
    everyone = as_json(cli("--json", "usage", "show", *PERIOD))  # default: by hour, every tenant
    assert everyone["group_by"] == "hour"
    assert {d["tenant_id"] for d in everyone["data"]} == {usage_world["a"], usage_world["b"]}


def test_usage_show_tables(cli: Cli, usage_world: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    one = cli("usage", "show", "--tenant", usage_world["a"], *PERIOD, "--group-by", "adapter")
    assert one.exit_code == 0, one.output
    lines = one.stdout.splitlines()
    assert lines[0] == "Usage from 2025-05-01 10:00Z to 2025-05-01 12:00Z, by adapter:"
    assert lines[1].split() == ["MODEL", "ADAPTER", "REQUESTS", "PROMPT", "CACHED", "COMPLETION", "GPU", "S"]
    support = next(line for line in lines if "support" in line).split()
    assert support == [MODEL, "support", "1", "0", "0", "1,000,000", "1.500"]
    assert lines[-1].split() == ["TOTAL", "2", "1,234,567", "0", "1,000,000", "1.500"]

    by_hour = cli("usage", "show", *PERIOD)  # every tenant: a TENANT column, folded to fit 80 columns
    assert by_hour.exit_code == 0, by_hour.output
    assert by_hour.stdout.splitlines()[1].split()[:2] == ["TENANT", "HOUR"]
    assert "…" not in by_hour.stdout and "1,234,567" in by_hour.stdout  # numbers are never cut
    assert max(len(line) for line in by_hour.stdout.splitlines()[1:]) <= 80
    monkeypatch.setenv("COLUMNS", "160")
    wide = cli("usage", "show", *PERIOD)
    b_row = next(line for line in wide.stdout.splitlines() if line.startswith(usage_world["b"])).split()
    assert b_row == [usage_world["b"], "2025-05-01", "10:00Z", "1", "5", "0", "5", "0.002"]

    by_batch = cli("usage", "show", "--tenant", usage_world["a"], *PERIOD, "--group-by", "batch")
    assert by_batch.exit_code == 0, by_batch.output
    assert by_batch.stdout.splitlines()[1].split()[:2] == ["BATCH", "REQUESTS"]
    assert by_batch.stdout.splitlines()[2].split()[:3] == ["interactive", "2", "1,234,567"]  # no batches

    empty = cli("usage", "show", "--tenant", usage_world["b"], "--start", "2020-01-01", "--end", "2020-01-02")
    assert empty.exit_code == 0, empty.output
    assert "No usage from 2020-01-01 00:00Z to 2020-01-02 00:00Z." in empty.stdout


def test_usage_bill(cli: Cli, usage_world: dict[str, str]) -> None:
    bill = as_json(cli("--json", "usage", "bill", usage_world["a"], *PERIOD))
    assert (bill["object"], bill["totals"]["total"]) == ("bill", "0.785185")  # 0.185185 + 0.600000
    human = cli("usage", "bill", usage_world["a"], *PERIOD)
    assert human.exit_code == 0, human.output
    out = human.stdout
    assert f"Bill for tenant {usage_world['a']} (tier {usage_world['tier']})" in out
    assert "2025-05-01 10:00Z to 2025-05-01 12:00Z, in USD" in out
    assert "input 0.150000" in out and "output 0.600000" in out and "per GB-day stored: 0.000000" in out
    assert "storage 0.000000, adjustment" in out
    base = next(line for line in out.splitlines() if line.startswith(MODEL) and " base " in line).split()
    assert base == [MODEL, "base", "1,234,567", "0", "0", "0.000000", "0.185185"]
    support = next(line for line in out.splitlines() if " support " in line).split()
    assert support == [MODEL, "support", "0", "0", "1,000,000", "1.500000", "0.600000"]
    assert "TOTAL" in out and out.splitlines()[-1] == "Total: 0.785185 USD"

    nothing = cli("usage", "bill", usage_world["b"], "--start", "2020-01-01", "--end", "2020-01-02")
    assert nothing.exit_code == 0, nothing.output
    assert "No usage billed" in nothing.stdout and "Total: 0.000000 USD" in nothing.stdout


def test_usage_errors(cli: Cli, usage_world: dict[str, str]) -> None:
    bad_time = cli("usage", "show", "--start", "last tuesday", "--end", "2025-05-02")
    assert bad_time.exit_code == 2 and "--start: 'last tuesday' is not a time" in bad_time.stderr
    missing = cli("usage", "show", "--start", "2025-05-01")
    assert missing.exit_code == 2 and "--end" in missing.output
    backwards = cli("usage", "show", "--start", "2025-05-02", "--end", "2025-05-01")
    assert backwards.exit_code == 1 and "end must be after start (HTTP 400)" in backwards.stderr
    too_long = cli("usage", "show", "--start", "2025-01-01", "--end", "2025-06-01")
    assert too_long.exit_code == 1 and "at most 93 days" in too_long.stderr
    half_hour = cli(
        "usage", "bill", usage_world["a"], "--start", "2025-05-01T10:30:00Z", "--end", "2025-05-02"
    )
    assert half_hour.exit_code == 1 and "whole UTC hour" in half_hour.stderr
    unknown = cli("usage", "bill", "ten_missing", *PERIOD)
    assert unknown.exit_code == 1 and "tenant 'ten_missing' not found (HTTP 404)" in unknown.stderr
    assert "Traceback" not in bad_time.output + backwards.output + unknown.output


def test_tier_prices(cli: Cli) -> None:
    name = unique("priced")
    created = as_json(
        cli("--json", "tiers", "create", name, "--price-input", "0.15", "--price-cached-input", ".075",
            "--price-output", "2", "--price-gpu-second", "0.000001", "--currency", "EUR")
    )  # fmt: skip
    fields = (
        "price_input_per_mtok",
        "price_cached_input_per_mtok",
        "price_output_per_mtok",
        "price_gpu_per_second",
    )
    assert [created[k] for k in (*fields, "currency")] == [
        "0.150000",
        "0.075000",
        "2.000000",
        "0.000001",
        "eur",
    ]
    updated = as_json(cli("--json", "tiers", "update", name, "--price-output", "2.5"))
    assert (updated["price_output_per_mtok"], updated["price_input_per_mtok"]) == ("2.500000", "0.150000")
    shown = cli("tiers", "get", name)
    assert shown.exit_code == 0, shown.output
    assert "0.150000 EUR / 1M tokens" in shown.stdout and "0.000001 EUR / GPU-second" in shown.stdout

    for price in ("-1", "0.0000001", "abc", "nan", "1e30"):
        bad = cli("tiers", "update", name, "--price-input", price)
        assert bad.exit_code == 2, (price, bad.output)
        assert "--price-input" in bad.stderr and "is not a price" in bad.stderr
    refused = cli("tiers", "update", name, "--currency", "euro")  # the API checks the currency
    assert refused.exit_code == 1 and "currency" in refused.stderr
    assert as_json(cli("--json", "tiers", "get", name))["price_input_per_mtok"] == "0.150000"


def test_tenant_stripe_customer(cli: Cli) -> None:
    tenant = as_json(cli("--json", "tenants", "create", unique("stripe")))
    assert tenant["stripe_customer_id"] is None
    tid = tenant["id"]
    assert as_json(cli("--json", "tenants", "update", tid, "--stripe-customer", "cus_Q1"))[
        "stripe_customer_id"
    ] == ("cus_Q1")
    shown = cli("tenants", "get", tid)
    assert shown.exit_code == 0 and "cus_Q1" in shown.stdout and "stripe customer" in shown.stdout
    bad = cli("tenants", "update", tid, "--stripe-customer", "acct_1")
    assert bad.exit_code == 1 and "stripe_customer_id" in bad.stderr
    both = cli("tenants", "update", tid, "--stripe-customer", "cus_Q2", "--clear-stripe-customer")
    assert both.exit_code == 2 and "contradict" in both.stderr
    cleared = as_json(cli("--json", "tenants", "update", tid, "--clear-stripe-customer"))
    assert cleared["stripe_customer_id"] is None
