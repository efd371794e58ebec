"""`loraplex tiers` and `loraplex tenants update` limit overrides against the live app."""

from collections.abc import Callable

from typer.testing import Result

from tests.app.conftest import Served
from tests.app.helpers import as_json, unique

LIMITS = ("rpm", "tpm", "max_concurrent", "max_tokens_cap")
Cli = Callable[..., Result]


def test_tier_lifecycle(cli: Cli) -> None:
    name = unique("gold")
    created = as_json(
        cli("--json", "tiers", "create", name, "--rpm", "120", "--tpm", "50000", "--max-concurrent", "4",
            "--on-limit", "queue", "--max-queue-ms", "2000", "--description", "Paid", "--weight", "2")
    )  # fmt: skip
    assert (created["name"], created["description"]) == (name, "Paid")
    assert [created[k] for k in LIMITS] == [120, 50_000, 4, None]
    assert (created["on_limit"], created["max_queue_ms"], created["weight"]) == ("queue", 2000, 2.0)
    assert as_json(cli("--json", "tiers", "get", name)) == created

    updated = as_json(
        cli("--json", "tiers", "update", name, "--rpm", "5", "--unlimited", "tpm,max-concurrent")
    )
    assert [updated[k] for k in LIMITS] == [5, None, None, None]
    assert (updated["on_limit"], updated["description"], updated["weight"]) == (
        "queue",
        "Paid",
        2.0,
    )  # untouched
    assert as_json(cli("--json", "tiers", "update", name, "--weight", "0.5"))["weight"] == 0.5
    assert created["batch_price_factor"] == "0.5000"  # half price unless told
    factor = cli("--json", "tiers", "update", name, "--batch-price-factor", "0.25")
    assert as_json(factor)["batch_price_factor"] == "0.2500"
    assert as_json(cli("--json", "tiers", "get", name))["weight"] == 0.5  # untouched by it
    assert created["max_stored_response_bytes"] is None  # no bound unless told
    quota = cli("--json", "tiers", "update", name, "--max-stored-response-bytes", "1000000")
    assert as_json(quota)["max_stored_response_bytes"] == 1_000_000
    assert created["price_storage_per_gb_day"] == "0.000000"  # storage is free unless priced
    storage = as_json(cli("--json", "tiers", "update", name, "--price-storage-gb-day", "0.25"))
    assert storage["price_storage_per_gb_day"] == "0.250000"
    assert "0.250000 USD / GB-day" in cli("tiers", "get", name).output
    refused = cli("tiers", "update", name, "--price-storage-gb-day", "-1")
    assert refused.exit_code == 2 and "--price-storage-gb-day" in refused.output
    unbounded = cli("--json", "tiers", "update", name, "--unlimited-stored-responses")
    assert as_json(unbounded)["max_stored_response_bytes"] is None
    back = as_json(cli("--json", "tiers", "update", name, "--on-limit", "reject", "--max-queue-ms", "0"))
    assert (back["on_limit"], back["max_queue_ms"], back["rpm"]) == ("reject", 0, 5)
    assert as_json(cli("--json", "tiers", "update", name, "--unlimited", "all"))["rpm"] is None

    listed = as_json(cli("--json", "tiers", "list"))
    assert listed["object"] == "list"
    assert {"free", "pro", "enterprise", name} <= {t["name"] for t in listed["data"]}


def test_human_output_is_tables(cli: Cli) -> None:
    name = unique("silver")
    made = cli("tiers", "create", name, "--rpm", "1500", "--description", "Mid", "--batch-price-factor", "1")
    assert made.exit_code == 0, made.output
    assert "1.0000 (Batch API lines" in made.stdout  # batches at full price
    assert "Created tier" in made.stdout
    assert "1,500" in made.stdout
    assert "unlimited" in made.stdout  # tpm and the others

    listing = cli("tiers", "list")
    assert listing.exit_code == 0, listing.output
    header = listing.stdout.splitlines()[0].split()
    assert header[:3] == ["NAME", "RPM", "TPM"]
    pro = next(line for line in listing.stdout.splitlines() if line.startswith("pro "))
    assert "600" in pro and "1,000,000" in pro and "queue 5000ms" in pro
    assert name in listing.stdout

    got = cli("tiers", "update", name, "--on-limit", "queue", "--max-queue-ms", "300")
    assert got.exit_code == 0, got.output
    assert "Updated tier" in got.stdout
    assert "queue up to 300 ms" in got.stdout


def test_tenant_overrides(cli: Cli) -> None:
    tenant = as_json(cli("--json", "tenants", "create", unique("ovr")))
    assert tenant["limits"]["rpm"] == 60

    updated = as_json(
        cli(
            "--json",
            "tenants",
            "update",
            tenant["id"],
            "--rpm",
            "2",
            "--max-tokens-cap",
            "16",
            "--tpm",
            "900",
        )
    )
    assert [updated[k] for k in LIMITS] == [2, 900, None, 16]
    assert (updated["limits"]["rpm"], updated["limits"]["max_concurrent"]) == (2, 8)

    human = cli("tenants", "get", tenant["id"])
    assert human.exit_code == 0, human.output
    assert "2 (override)" in human.stdout
    assert "8 (tier free)" in human.stdout

    cleared = as_json(cli("--json", "tenants", "update", tenant["id"], "--clear-overrides", "rpm,tpm"))
    assert [cleared[k] for k in LIMITS] == [None, None, None, 16]
    assert cleared["limits"]["rpm"] == 60
    none_left = as_json(cli("--json", "tenants", "update", tenant["id"], "--clear-overrides", "all"))
    assert [none_left[k] for k in LIMITS] == [None] * 4


def test_usage_errors_exit_2_without_a_request(cli: Cli, served: Served) -> None:
    tenant = as_json(cli("--json", "tenants", "create", unique("usage")))
    cases = [
        (("tiers", "update", "free"), "nothing to update"),
        (("tiers", "update", "free", "--unlimited", "burst"), "unknown limit 'burst'"),
        (("tiers", "update", "free", "--rpm", "5", "--unlimited", "rpm"), "contradict"),
        (("tiers", "create", unique("x"), "--rpm", "0"), "--rpm"),
        (("tiers", "create", unique("x"), "--on-limit", "drop"), "--on-limit"),
        (("tiers", "create", unique("x"), "--max-queue-ms", "70000"), "--max-queue-ms"),
        (("tiers", "update", "free", "--batch-price-factor", "1.5"), "'1.5' is not a price factor"),
        (("tiers", "update", "free", "--batch-price-factor", "0.12345"), "is not a price factor"),
        (("tiers", "create", unique("x"), "--batch-price-factor", "half"), "is not a price factor"),
        (("tenants", "update", tenant["id"], "--clear-overrides", "on_limit"), "unknown limit 'on_limit'"),
        (("tenants", "update", tenant["id"], "--tpm", "-1"), "--tpm"),
        (("tenants", "update", tenant["id"]), "nothing to update"),
    ]
    for args, message in cases:
        result = cli(*args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.output
    assert as_json(cli("--json", "tiers", "get", "free"))["rpm"] == 60  # nothing was sent


def test_api_errors_exit_1_with_the_message(cli: Cli) -> None:
    missing = cli("tiers", "get", "platinum")
    assert missing.exit_code == 1
    assert "tier 'platinum' not found" in missing.stderr
    assert "404" in missing.stderr

    duplicate = cli("tiers", "create", "free")
    assert duplicate.exit_code == 1
    assert "tier 'free' already exists (HTTP 409)" in duplicate.stderr

    queue = cli("tiers", "create", unique("q"), "--on-limit", "queue")  # queueing for 0 ms
    assert queue.exit_code == 1
    assert "max_queue_ms must be more than 0 when on_limit is 'queue'" in queue.stderr

    bad_name = cli("tiers", "create", "has space")
    assert bad_name.exit_code == 1
    assert "name" in bad_name.stderr and "400" in bad_name.stderr
    assert bad_name.stdout == ""

    unknown_tenant = cli("tenants", "update", "ten_nosuchtenant", "--rpm", "3")
    assert unknown_tenant.exit_code == 1
    assert "not found" in unknown_tenant.stderr
