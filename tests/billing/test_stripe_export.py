"""The Stripe Billing Meters export against a stub of Stripe's API, driven by the real SDK, on both backends.

Times are real (the stub checks Stripe's 35-day window against its clock): usage lands a few hours back, in
closed hours, plus some in the current hour, which must not be exported yet.
"""

import itertools
import re
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import stripe
from pydantic import SecretStr, ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from bench.stripe_stub import EVENT_NAMES, StripeStub
from billing.db import session_scope
from billing.models import StripeExport, Tenant, UsageRollup
from billing.stripe_config import StripeConfig
from billing.stripe_export import (
    METER_KEYS,
    TOO_OLD,
    Discrepancy,
    ExportDisabled,
    ExportSummary,
    export_usage,
    is_duplicate_identifier,
    make_client,
    plan_exports,
    reconcile,
)
from billing.usage import UsageRecord, closed_before, hour_of, record_usage, rollup_hours

METER = dict(zip(METER_KEYS, EVENT_NAMES, strict=True))
CUSTOMERS = {"ten_acme": "cus_acme", "ten_beta": "cus_beta", "ten_nocus": None}
IDENTIFIER = re.compile(r"^ru_[0-9a-f]{24}-(input_tokens|cached_input_tokens|output_tokens|gpu_ms)-r\d+$")
_request_ids = itertools.count()


@pytest.fixture
def sessions(session_factory: sessionmaker[Session], now: datetime) -> sessionmaker[Session]:
    """Three tenants (one without a Stripe customer) with usage in three closed hours and the open one."""
    with session_scope(session_factory) as s:
        s.add_all(
            Tenant(id=tid, name=tid, tier="free", stripe_customer_id=cus) for tid, cus in CUSTOMERS.items()
        )
    base = hour_of(now)
    records = []
    for tenant in CUSTOMERS:
        for back, adapter in itertools.product((2, 3, 4), (None, "ad_one")):
            hour = base - timedelta(hours=back)
            records += [usage(tenant, hour + timedelta(minutes=5), 100 * back, 30, 7 * back, 100.3, adapter),
                        usage(tenant, hour + timedelta(minutes=40), 50, 0, 11, 0.3, adapter)]  # fmt: skip
        records.append(usage(tenant, base, 999, 0, 999, 999.0))  # the open hour
    add_usage(session_factory, records, now)
    return session_factory


def usage(
    tenant: str,
    started_at: datetime,
    prompt: int,
    cached: int,
    completion: int,
    gpu_ms: float,
    adapter: str | None = None,
) -> UsageRecord:
    return UsageRecord(
        request_id=f"req-{next(_request_ids)}", tenant_id=tenant, key_id="key_x", model="tiny",
        base_model="tiny", adapter_id=adapter, adapter_version=1 if adapter else None, status="completed",
        finish_reason="stop", prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion,
        gpu_ms=gpu_ms, queue_ms=0.0, ttft_ms=1.0, latency_ms=2.0, replica="r0", started_at=started_at,
        finished_at=started_at + timedelta(seconds=1),
    )  # fmt: skip


def add_usage(factory: sessionmaker[Session], records: list[UsageRecord], now: datetime) -> None:
    with session_scope(factory) as s:
        record_usage(s, records)
        rollup_hours(s, start=min(r.started_at for r in records), end=now + timedelta(hours=1))


def config(stub: StripeStub, **overrides: Any) -> StripeConfig:
    return StripeConfig(api_key=SecretStr(stub.api_key), api_base=stub.url, **overrides)


def run(
    factory: sessionmaker[Session],
    stub: StripeStub,
    now: datetime,
    sleeps: list[float] | None = None,
    **overrides: Any,
) -> ExportSummary:
    """One export with quick backoff; the waits it asked for are appended to `sleeps`."""
    waits = sleeps if sleeps is not None else []
    return export_usage(factory, config(stub, **overrides), now=now, backoff_s=0.01, sleep=waits.append)


def rollup_totals(factory: sessionmaker[Session], now: datetime) -> dict[tuple[str, str], int]:
    """What Stripe should hold: closed rollups of billed tenants, per customer and meter."""
    totals: dict[tuple[str, str], int] = defaultdict(int)
    with factory() as s:
        query = (
            select(UsageRollup, Tenant.stripe_customer_id)
            .join(Tenant, Tenant.id == UsageRollup.tenant_id)
            .where(UsageRollup.hour < closed_before(now), Tenant.stripe_customer_id.is_not(None))
        )
        for r, customer in s.execute(query).tuples():
            assert customer is not None
            totals[customer, METER["input_tokens"]] += r.prompt_tokens - r.cached_tokens
            totals[customer, METER["cached_input_tokens"]] += r.cached_tokens
            totals[customer, METER["output_tokens"]] += r.completion_tokens
            totals[customer, METER["gpu_ms"]] += round(r.gpu_ms)
    return {key: value for key, value in totals.items() if value}


def exports(factory: sessionmaker[Session]) -> list[StripeExport]:
    with factory() as s:
        return list(s.scalars(select(StripeExport).order_by(StripeExport.identifier)))


def no_duplicates(stub: StripeStub) -> None:
    identifiers = [e.identifier for e in stub.events]
    assert len(identifiers) == len(set(identifiers))


def test_exported_totals_equal_the_rollups_per_customer_and_meter(
    sessions: sessionmaker[Session], stub: StripeStub, now: datetime
) -> None:
    summary = run(sessions, stub, now)

    expected = rollup_totals(sessions, now)
    assert stub.totals() == expected
    # Per-rollup rounding of GPU time: 100.3 + 0.3 ms is 101 ms per rollup, 6 rollups per customer.
    assert expected["cus_acme", METER["gpu_ms"]] == 6 * 101
    assert {customer for customer, _ in expected} == {"cus_acme", "cus_beta"}  # not the open hour's 999s
    assert summary.sent == summary.created == len(stub.events) == 2 * 6 * 4
    assert (summary.failed, summary.skipped, summary.pending, summary.duplicates) == (0, 0, 0, 0)
    rows = exports(sessions)
    assert {r.status for r in rows} == {"sent"} and all(r.sent_at and r.attempts == 1 for r in rows)
    assert all(IDENTIFIER.match(r.identifier) and len(r.identifier) <= 100 for r in rows)
    assert all(r.identifier.endswith("-r1") and r.revision == 1 for r in rows)
    closed = closed_before(now)
    for event in stub.events:  # inside its hour, never on a boundary, never in an open hour
        moment = datetime.fromtimestamp(event.timestamp, UTC)
        assert moment.minute == 30 and moment < closed
    no_duplicates(stub)


def test_a_second_run_sends_nothing_new(
    sessions: sessionmaker[Session], stub: StripeStub, now: datetime
) -> None:
    run(sessions, stub, now)
    posts = len(stub.requests)

    again = run(sessions, stub, now)

    assert (again.created, again.sent, again.failed, again.skipped, again.pending) == (0, 0, 0, 0, 0)
    assert len(stub.requests) == posts
    assert stub.totals() == rollup_totals(sessions, now)


def test_late_events_send_exactly_the_increase_under_a_new_identifier(
    sessions: sessionmaker[Session], stub: StripeStub, now: datetime
) -> None:
    run(sessions, stub, now)
    before = stub.totals()
    late_hour = hour_of(now) - timedelta(hours=3)
    add_usage(sessions, [usage("ten_acme", late_hour + timedelta(minutes=59), 40, 15, 5, 2.6)], now)

    summary = run(sessions, stub, now)

    assert summary.created == summary.sent == 4
    increase = {"input_tokens": 25, "cached_input_tokens": 15, "output_tokens": 5, "gpu_ms": 2}  # 101 -> 103
    late = stub.events[-4:]
    assert {e.event_name: e.value for e in late} == {METER[k]: v for k, v in increase.items()}
    assert all(e.identifier.endswith("-r2") and e.customer == "cus_acme" for e in late)
    assert all(e.timestamp == int((late_hour + timedelta(minutes=30)).timestamp()) for e in late)
    for key, value in increase.items():
        assert stub.totals()["cus_acme", METER[key]] == before["cus_acme", METER[key]] + value
    assert stub.totals() == rollup_totals(sessions, now)
    no_duplicates(stub)


def test_500s_429s_and_lost_answers_are_retried_to_a_consistent_end(
    sessions: sessionmaker[Session], stub: StripeStub, now: datetime
) -> None:
    stub.fail_next(2, "500")  # retried by the SDK itself, same Idempotency-Key
    stub.fail_next(1, "429", retry_after=2)  # the SDK leaves 429 to us: our backoff, honouring Retry-After
    stub.fail_next(1, "drop", after_record=True)  # recorded, answer lost: the SDK's retry gets a replay
    stub.fail_next(1, "500")
    sleeps: list[float] = []

    summary = run(sessions, stub, now, sleeps)

    assert (summary.failed, summary.pending) == (0, 0) and summary.sent == 48
    assert 2.0 in sleeps
    assert stub.replays == 1
    assert stub.totals() == rollup_totals(sessions, now)
    no_duplicates(stub)


def test_an_event_stripe_already_has_is_counted_as_sent_not_sent_twice(
    sessions: sessionmaker[Session], stub: StripeStub, now: datetime
) -> None:
    # Without SDK retries, our own retry is a new request (new Idempotency-Key) for an event Stripe holds:
    # the first answer is lost after recording, then even the refusal of the retry is lost (a 500).
    stub.fail_next(1, "drop", after_record=True)
    stub.fail_next(1, "500", after_record=True)

    summary = run(sessions, stub, now, max_network_retries=0)

    assert (summary.sent, summary.failed, summary.duplicates) == (48, 0, 1)
    assert len(stub.duplicates) == 2 and len(set(stub.duplicates)) == 1
    assert stub.totals() == rollup_totals(sessions, now)
    no_duplicates(stub)


def test_a_crash_after_stripe_accepted_is_repaired_by_the_next_run(
    sessions: sessionmaker[Session], stub: StripeStub, now: datetime
) -> None:
    # The answer to the first event is lost and no retry is allowed: Stripe has it, the log says pending,
    # exactly as if the exporter had crashed before its commit.
    stub.fail_next(1, "drop", after_record=True)
    first = export_usage(
        sessions, config(stub, max_network_retries=0), now=now, retries=0, sleep=lambda _: None
    )
    assert (first.sent, first.failed, first.pending, len(stub.events)) == (0, 1, 48, 1)  # it stopped there
    lost = next(r for r in exports(sessions) if r.attempts)
    assert lost.status == "pending" and "APIConnectionError" in (lost.last_error or "")
    assert stub.events[0].identifier == lost.identifier

    second = run(sessions, stub, now)

    assert (second.sent, second.duplicates, second.pending) == (48, 1, 0)
    assert stub.duplicates == [lost.identifier]
    assert stub.totals() == rollup_totals(sessions, now)


def test_an_outage_stops_the_run_and_a_later_run_sends_everything(
    sessions: sessionmaker[Session], stub: StripeStub, now: datetime
) -> None:
    stub.fail_next(2, "500")
    cfg = config(stub, max_network_retries=0)

    failing = export_usage(sessions, cfg, now=now, retries=1, backoff_s=0.001, sleep=lambda _: None)

    # Still failing after its retry: Stripe is down, so the run stops instead of waiting on every event.
    assert (failing.created, failing.sent, failing.failed, failing.pending) == (48, 0, 1, 48)
    assert not stub.events and len(stub.requests) == 2
    tried = [r for r in exports(sessions) if r.attempts]
    assert len(tried) == 1 and tried[0].status == "pending" and tried[0].attempts == 2
    assert "APIError (HTTP 500)" in (tried[0].last_error or "")

    recovered = run(sessions, stub, now)

    assert (recovered.created, recovered.sent, recovered.failed, recovered.pending) == (0, 48, 0, 0)
    rows = exports(sessions)
    assert all(r.status == "sent" and r.last_error is None for r in rows)
    assert sorted(r.attempts for r in rows) == [1] * 47 + [3]
    assert stub.totals() == rollup_totals(sessions, now)


def test_a_refused_event_does_not_hold_up_the_others(
    sessions: sessionmaker[Session], stub: StripeStub, now: datetime
) -> None:
    stub.fail_next(1, "400")

    first = run(sessions, stub, now)

    assert (first.sent, first.failed, first.pending) == (47, 1, 1)
    refused = next(r for r in exports(sessions) if r.status == "pending")
    assert refused.attempts == 1 and "InvalidRequestError (HTTP 400)" in (refused.last_error or "")
    second = run(sessions, stub, now)
    assert (second.sent, second.failed, second.pending) == (1, 0, 0)
    assert stub.totals() == rollup_totals(sessions, now)


def test_a_rejected_api_key_stops_the_run_after_one_call(
    sessions: sessionmaker[Session], stub: StripeStub, now: datetime
) -> None:
    cfg = config(stub).model_copy(update={"api_key": SecretStr("sk_test_wrong")})

    summary = export_usage(sessions, cfg, now=now, sleep=lambda _: None)

    assert (summary.sent, summary.failed, summary.pending) == (0, 1, 48)
    assert len(stub.requests) == 1 and stub.requests[0][2] == 401


def test_tenants_without_a_stripe_customer_are_not_exported(
    sessions: sessionmaker[Session], stub: StripeStub, now: datetime
) -> None:
    run(sessions, stub, now)

    with sessions() as s:
        unbilled = set(s.scalars(select(UsageRollup.id).where(UsageRollup.tenant_id == "ten_nocus")))
    assert unbilled
    assert not [r for r in exports(sessions) if r.rollup_id in unbilled]
    assert {e.customer for e in stub.events} == {"cus_acme", "cus_beta"}


def test_rollups_older_than_35_days_are_skipped_and_never_sent(
    sessions: sessionmaker[Session], stub: StripeStub, now: datetime
) -> None:
    billable = rollup_totals(sessions, now)
    old_hour = hour_of(now) - timedelta(days=40)
    add_usage(sessions, [usage("ten_acme", old_hour + timedelta(minutes=1), 10, 0, 10, 10.0)], now)

    summary = run(sessions, stub, now)

    old = [r for r in exports(sessions) if r.timestamp < now - timedelta(days=35)]
    assert len(old) == summary.skipped == 3  # no cached tokens: nothing on that meter
    assert all(r.status == "skipped" and r.last_error == TOO_OLD and r.attempts == 0 for r in old)
    assert not {r.identifier for r in old} & {e.identifier for e in stub.events}
    assert stub.totals() == billable
    again = run(sessions, stub, now)
    assert (again.created, again.skipped, again.sent) == (0, 0, 0)


def test_a_pending_event_that_aged_past_the_window_is_skipped_not_sent(
    session_factory: sessionmaker[Session], stub: StripeStub, now: datetime
) -> None:
    with session_scope(session_factory) as s:
        s.add(Tenant(id="ten_acme", name="acme", tier="free", stripe_customer_id="cus_acme"))
    then = now - timedelta(days=36)
    add_usage(session_factory, [usage("ten_acme", hour_of(then) - timedelta(hours=2), 5, 0, 5, 5.0)], now)
    assert plan_exports(session_factory, config(stub), now=then) == (3, 0, 0)  # planned back then, never sent

    summary = run(session_factory, stub, now)

    assert (summary.created, summary.sent, summary.skipped, summary.pending) == (0, 0, 3, 0)
    assert all(r.status == "skipped" and r.last_error == TOO_OLD for r in exports(session_factory))
    assert not stub.events


def test_batch_limit_sends_the_oldest_first_and_leaves_the_rest_pending(
    sessions: sessionmaker[Session], stub: StripeStub, now: datetime
) -> None:
    first = run(sessions, stub, now, batch_limit=10)
    assert (first.created, first.sent, first.pending) == (48, 10, 38)
    rows = exports(sessions)
    sent = [r.timestamp for r in rows if r.status == "sent"]
    assert max(sent) <= min(r.timestamp for r in rows if r.status == "pending")  # planned hour by hour

    second = run(sessions, stub, now, batch_limit=40)

    assert (second.created, second.sent, second.pending) == (0, 38, 0)
    assert stub.totals() == rollup_totals(sessions, now)


def test_reconcile_is_clean_after_an_export_and_reports_a_tampered_stripe_total(
    sessions: sessionmaker[Session], stub: StripeStub, now: datetime
) -> None:
    run(sessions, stub, now)
    cfg = config(stub)
    client = make_client(cfg)
    start, end = hour_of(now) - timedelta(hours=24), hour_of(now) + timedelta(hours=1)
    with sessions() as s:
        assert reconcile(s, start=start, end=end, config=cfg, client=client, now=now) == []

        moment = int((hour_of(now) - timedelta(hours=3, minutes=15)).timestamp())
        stub.tamper("cus_beta", METER["output_tokens"], 7, moment)
        found = reconcile(s, start=start, end=end, config=cfg, client=client, now=now)

    sent = rollup_totals(sessions, now)["cus_beta", METER["output_tokens"]]
    assert found == [Discrepancy("cus_beta", METER["output_tokens"], sent, sent, 0, 0, sent + 7)]


def test_reconcile_reports_usage_not_exported_yet(
    sessions: sessionmaker[Session], stub: StripeStub, now: datetime
) -> None:
    run(sessions, stub, now)
    add_usage(sessions, [usage("ten_beta", hour_of(now) - timedelta(hours=4), 0, 0, 0, 9.0)], now)
    start, end = hour_of(now) - timedelta(hours=6), hour_of(now)
    cfg = config(stub)
    with sessions() as s:
        found = reconcile(s, start=start, end=end, config=cfg, now=now)
    totals = rollup_totals(sessions, now)
    gpu = totals["cus_beta", METER["gpu_ms"]]
    assert found == [Discrepancy("cus_beta", METER["gpu_ms"], gpu, gpu - 9, 0, 0, None)]

    run(sessions, stub, now)
    with sessions() as s:
        assert reconcile(s, start=start, end=end, config=cfg, client=make_client(cfg), now=now) == []


def test_reconcile_needs_whole_hours(session_factory: sessionmaker[Session]) -> None:
    start = datetime(2026, 1, 1, tzinfo=UTC)
    with session_factory() as s, pytest.raises(ValueError, match="whole UTC hour"):
        reconcile(
            s, start=start + timedelta(minutes=1), end=start + timedelta(hours=2), config=StripeConfig()
        )


def invalid_request(message: str, code: str | None = None) -> stripe.InvalidRequestError:
    return stripe.InvalidRequestError(message, "identifier", code, http_status=400)  # type: ignore[no-untyped-call]


def test_a_reused_identifier_is_recognised_by_its_message_or_a_code() -> None:
    message = "An event already exists with identifier ru_x-gpu_ms-r1."
    assert is_duplicate_identifier(invalid_request(message))
    assert is_duplicate_identifier(invalid_request("Duplicate.", code="resource_already_exists"))
    assert not is_duplicate_identifier(invalid_request("No such customer: 'cus_x'"))
    assert not is_duplicate_identifier(stripe.RateLimitError(message, http_status=429))


def test_config_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not StripeConfig().enabled
    with pytest.raises(ExportDisabled):
        make_client(StripeConfig())
    monkeypatch.setenv("LORAPLEX_STRIPE_API_KEY", "sk_test_x")
    monkeypatch.setenv("LORAPLEX_STRIPE_METER_GPU_MS", "gpu_time")
    cfg = StripeConfig()
    assert cfg.enabled and cfg.event_names()["gpu_ms"] == "gpu_time" and cfg.max_network_retries == 3
    monkeypatch.setenv("LORAPLEX_STRIPE_METER_INPUT_TOKENS", "gpu_time")
    with pytest.raises(ValidationError, match="must differ"):
        StripeConfig()


def test_progress_counts_every_event_of_the_batch(
    sessions: sessionmaker[Session], stub: StripeStub, now: datetime
) -> None:
    seen: list[tuple[int, int]] = []
    summary = export_usage(
        sessions, config(stub), now=now, backoff_s=0.01, sleep=lambda _: None,
        on_progress=lambda done, total: seen.append((done, total)),
    )  # fmt: skip
    total = summary.sent
    assert seen == [(done, total) for done in range(total + 1)]
