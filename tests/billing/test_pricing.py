"""Prices and bills: exact Decimal arithmetic, tier prices and Stripe customer ids in the repository, and
bills computed from rollups on both backends."""

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from billing import pricing
from billing import repository as repo
from billing.db import session_scope
from billing.errors import InvalidLimits, InvalidPrice, InvalidStripeCustomer, TenantNotFound
from billing.micros import to_micros
from billing.models import PriceChange, Tier, UsageRollup
from billing.price_book import Metered, cost_of, prices_at
from billing.pricing import InvalidPeriod, Prices, bill, gpu_cost, gpu_seconds_of, ms_decimal, token_cost
from billing.stripe_export import meter_values
from billing.usage import rollup_hours
from tests.billing.test_usage_queries import MODEL, make_adapter, make_event

T0 = datetime(2025, 3, 1, 10, 0, tzinfo=UTC)
PRICES: dict[str, Any] = {
    "price_input_per_mtok": "0.15",
    "price_cached_input_per_mtok": "0.075",
    "price_output_per_mtok": "0.6",
    "price_gpu_per_second": "0.000123",
}


@pytest.fixture
def s(session_factory: sessionmaker[Session]) -> Iterator[Session]:
    with session_factory() as session:
        yield session


# --- arithmetic ------------------------------------------------------------------------------------------


def test_token_cost_is_exact_where_floats_drift() -> None:
    # 1,234,567 x 0.15 / 1e6 is 0.18518505 exactly. As a float it is 0.18518504999999998994..., and adding
    # up per-request float costs drifts further (0.18518505000311158 over 1,234,567 one-token requests).
    assert Decimal(1_234_567 * 0.15 / 1e6) != Decimal("0.18518505")
    assert sum(0.15 / 1e6 for _ in range(1_234_567)) != 0.18518505
    assert token_cost(1_234_567, Decimal("0.15")) == Decimal("0.185185")
    assert str(token_cost(1_234_567, Decimal("0.15"))) == "0.185185"
    assert token_cost(1_234_567, Decimal("0.15")) + token_cost(1_234_567, Decimal("0.15")) == Decimal(
        "0.37037"
    )
    assert 0.1 * 3 != 0.3 and token_cost(3_000_000, Decimal("0.1")) == Decimal("0.3")
    assert token_cost(0, Decimal("5")) == 0
    assert token_cost(1_000_000, Decimal("0.000001")) == Decimal("0.000001")


def test_rounding_is_half_even_and_happens_once() -> None:
    assert token_cost(5, Decimal("0.1")) == Decimal("0.000000")  # 0.0000005 -> even (0)
    assert token_cost(15, Decimal("0.1")) == Decimal("0.000002")  # 0.0000015 -> even (2)
    assert token_cost(25, Decimal("0.1")) == Decimal("0.000002")  # 0.0000025 -> even (2)
    assert token_cost(26, Decimal("0.1")) == Decimal("0.000003")
    assert token_cost(3, Decimal("0.333333")) == Decimal("0.000001")  # 0.000000999999


def test_large_quantities_are_exact_too() -> None:
    """BIGINT token counts times the largest price: beyond the default 28-digit context, still exact."""
    tokens = 2**63 - 1
    cost = token_cost(tokens, repo.PRICE_MAX)
    assert cost == (Decimal(tokens) * Decimal("999999999.999999")).scaleb(-6).quantize(Decimal("0.000001"))
    assert cost == Decimal("9223372036854766583627.963145")


def test_gpu_seconds_come_from_the_doubles_shortest_form() -> None:
    assert ms_decimal(0.1) == Decimal("0.1")  # not 0.1000000000000000055511151231257827
    assert gpu_seconds_of(Decimal("1234.5678")) == Decimal("1.234568")  # ms -> s, 6 decimals, half even
    assert gpu_seconds_of(Decimal("0.0005")) == Decimal("0.000000")  # 0.0000005 s -> even
    assert gpu_cost(Decimal("3600"), Decimal("0.000123")) == Decimal("0.442800")


def test_periods_are_whole_utc_hours() -> None:
    assert pricing.check_period(T0.replace(tzinfo=None), T0 + timedelta(hours=1)) == (
        T0,
        T0 + timedelta(hours=1),
    )
    with pytest.raises(InvalidPeriod, match="start must be a whole UTC hour") as error:
        pricing.check_period(T0 + timedelta(minutes=30), T0 + timedelta(hours=1))
    assert error.value.param == "start"
    with pytest.raises(InvalidPeriod) as error:
        pricing.check_period(T0, T0 + timedelta(hours=1, seconds=1))
    assert error.value.param == "end"
    with pytest.raises(InvalidPeriod, match="after start"):
        pricing.check_period(T0, T0)
    # 10:30 +05:30 is 05:00Z: a whole hour; 10:00 +05:30 is 04:30Z: not
    assert pricing.check_period(datetime.fromisoformat("2025-03-01T10:30:00+05:30"), T0)[0].hour == 5
    with pytest.raises(InvalidPeriod):
        pricing.check_period(datetime.fromisoformat("2025-03-01T10:00:00+05:30"), T0)


# --- prices and customers in the repository ----------------------------------------------------------------


def prices_of(tier: Tier) -> tuple[Decimal, ...]:
    return tuple(getattr(tier, field) for field in repo.PRICE_FIELDS)


def test_tier_prices_round_trip_exactly(session_factory: sessionmaker[Session]) -> None:
    with session_scope(session_factory) as s:
        repo.create_tier(s, name="metered", **PRICES, currency="EUR")
        repo.create_tier(s, name="dear", price_input_per_mtok=repo.PRICE_MAX, price_output_per_mtok=12)
    with session_factory() as s:
        metered = repo.get_tier(s, name="metered")
        assert prices_of(metered) == tuple(Decimal(v) for v in PRICES.values())
        assert [str(p) for p in prices_of(metered)] == ["0.150000", "0.075000", "0.600000", "0.000123"]
        assert metered.currency == "eur"
        dear = repo.get_tier(s, name="dear")  # 15 significant digits survive SQLite's doubles
        assert prices_of(dear) == (Decimal("999999999.999999"), Decimal(0), Decimal(12), Decimal(0))
        free = repo.get_tier(s, name="free")  # seeded before prices existed: 0, usd
        assert (prices_of(free), free.currency) == ((Decimal(0),) * 4, "usd")


def test_update_tier_changes_only_the_prices_given(session_factory: sessionmaker[Session]) -> None:
    with session_scope(session_factory) as s:
        repo.create_tier(s, name="metered", rpm=10, **PRICES)
    with session_scope(session_factory) as s:
        repo.update_tier(s, name="metered", price_output_per_mtok=Decimal("1.25"), currency="gbp")
    with session_factory() as s:
        tier = repo.get_tier(s, name="metered")
        assert prices_of(tier) == (Decimal("0.15"), Decimal("0.075"), Decimal("1.25"), Decimal("0.000123"))
        assert (tier.currency, tier.rpm) == ("gbp", 10)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"price_input_per_mtok": -1}, "price_input_per_mtok"),
        ({"price_cached_input_per_mtok": "0.0000001"}, "price_cached_input_per_mtok"),  # 7 decimals
        ({"price_output_per_mtok": Decimal("1.0000000000000000000000000000001")}, "price_output_per_mtok"),
        ({"price_output_per_mtok": 0.5}, "price_output_per_mtok"),  # a float: refused
        ({"price_gpu_per_second": "NaN"}, "price_gpu_per_second"),
        ({"price_gpu_per_second": "Infinity"}, "price_gpu_per_second"),
        ({"price_gpu_per_second": "abc"}, "price_gpu_per_second"),
        ({"price_input_per_mtok": None}, "price_input_per_mtok"),
        ({"price_input_per_mtok": True}, "price_input_per_mtok"),
        ({"price_input_per_mtok": "1000000000"}, "price_input_per_mtok"),  # over PRICE_MAX
        ({"currency": "us"}, "currency"),
        ({"currency": "dollars"}, "currency"),
    ],
)
def test_bad_prices_name_the_field_and_write_nothing(
    session_factory: sessionmaker[Session], changes: dict[str, Any], field: str
) -> None:
    with session_scope(session_factory) as s:
        repo.create_tier(s, name="metered", **PRICES)
    with session_factory() as s:
        with pytest.raises(InvalidPrice) as error:
            repo.update_tier(s, name="metered", rpm=5, **changes)
        assert isinstance(error.value, InvalidLimits) and error.value.field == field
        with pytest.raises(InvalidPrice):
            repo.create_tier(s, name="other", **changes)
        s.rollback()
    with session_factory() as s:
        tier = repo.get_tier(s, name="metered")
        assert tier.rpm is None and prices_of(tier) == tuple(Decimal(v) for v in PRICES.values())


def test_stripe_customer_is_set_cleared_and_checked(s: Session) -> None:
    tenant_id = repo.create_tenant(s, name="acme").id

    def customer() -> tuple[str, str | None]:
        tenant = repo.get_tenant(s, tenant_id=tenant_id)
        return tenant.name, tenant.stripe_customer_id

    assert customer() == ("acme", None)
    repo.update_tenant(s, tenant_id=tenant_id, stripe_customer_id="cus_Abc123")
    assert customer() == ("acme", "cus_Abc123")
    repo.update_tenant(s, tenant_id=tenant_id, name="acme-2")  # UNSET: left as it is
    assert customer() == ("acme-2", "cus_Abc123")
    for bad in ("cust_1", "cus_", "acme", "cus_a b", "cus_" + "x" * 61):
        with pytest.raises(InvalidStripeCustomer) as error:
            repo.update_tenant(s, tenant_id=tenant_id, name="acme-3", stripe_customer_id=bad)
        assert error.value.field == "stripe_customer_id"
    assert customer() == ("acme-2", "cus_Abc123")  # all or nothing: not renamed either
    repo.update_tenant(s, tenant_id=tenant_id, stripe_customer_id=None)
    assert customer() == ("acme-2", None)


# --- bills from rollups ----------------------------------------------------------------------------------


def seed(s: Session) -> dict[str, str]:
    """Tenant a on a priced tier with usage over two hours (base model and an adapter); tenant b on the
    same tier with usage that a's bill must not contain. Then the hours are rolled up."""
    repo.create_tier(s, name="metered", **PRICES)
    a = repo.create_tenant(s, name="a", tier="metered").id
    b = repo.create_tenant(s, name="b", tier="metered").id
    support = make_adapter(s, a, "support")
    s.add_all(
        [
            make_event(a, T0, prompt_tokens=1_000_000, cached_tokens=234_567, completion_tokens=200_000,
                       gpu_ms=1000.1),
            make_event(a, T0 + timedelta(minutes=30), prompt_tokens=1_234_567, cached_tokens=0,
                       completion_tokens=1, gpu_ms=0.2),
            make_event(a, T0 + timedelta(hours=1), prompt_tokens=10, cached_tokens=0, completion_tokens=0,
                       gpu_ms=0.1),
            make_event(a, T0 + timedelta(minutes=1), adapter_id=support, prompt_tokens=3, cached_tokens=1,
                       completion_tokens=25, gpu_ms=2.5),
            make_event(b, T0, prompt_tokens=9_000_000, completion_tokens=9_000_000, gpu_ms=9e6),
            make_event(a, T0 + timedelta(hours=2), prompt_tokens=777),  # after the period
        ]
    )  # fmt: skip
    s.flush()
    rollup_hours(s, start=T0, end=T0 + timedelta(hours=3))
    return {"a": a, "b": b, "support": support}


def line_tuple(line: pricing.BillLine) -> tuple[Any, ...]:
    return (
        line.base_model, line.adapter, line.requests, line.input_tokens, line.cached_input_tokens,
        line.output_tokens, line.gpu_seconds, line.input_cost, line.cached_input_cost, line.output_cost,
        line.gpu_cost, line.total,
    )  # fmt: skip


def test_bill_from_rollups_is_exact(session_factory: sessionmaker[Session]) -> None:
    with session_scope(session_factory) as s:
        ids = seed(s)
    with session_factory() as s:
        result = bill(s, tenant_id=ids["a"], start=T0, end=T0 + timedelta(hours=2))
    d = Decimal
    # base: input 765,433 + 1,234,567 + 10 = 2,000,010 -> 0.3000015 -> 0.300002 (half even: ...15 -> 2)
    #       cached 234,567 x 0.075 = 0.017592525 -> 0.017593; output 200,001 x 0.6 = 0.1200006 -> 0.120001
    #       gpu 1000.1 + 0.2 + 0.1 ms = 1.0004 s x 0.000123 = 0.0001230492 -> 0.000123
    # support: input 2 x 0.15 = 0.0000003 -> 0.000000; cached 1 -> 0.000000; output 25 x 0.6 = 0.000015;
    #       gpu 0.0025 s -> 0.0000003075 -> 0.000000
    assert [line_tuple(line) for line in result.lines] == [
        (MODEL, "base", 3, 2_000_010, 234_567, 200_001, d("1.000400"), d("0.300002"), d("0.017593"),
         d("0.120001"), d("0.000123"), d("0.437719")),
        (MODEL, "support", 1, 2, 1, 25, d("0.002500"), d("0.000000"), d("0.000000"), d("0.000015"),
         d("0.000000"), d("0.000015")),
    ]  # fmt: skip
    assert result.lines[1].adapter_id == ids["support"] and result.lines[0].adapter_id is None
    t = result.totals
    assert (t.requests, t.input_tokens, t.cached_input_tokens, t.output_tokens) == (
        4,
        2_000_012,
        234_568,
        200_026,
    )
    assert (t.gpu_seconds, t.input_cost, t.cached_input_cost, t.output_cost, t.gpu_cost, t.total) == (
        d("1.002900"), d("0.300002"), d("0.017593"), d("0.120016"), d("0.000123"), d("0.437734"),
    )  # fmt: skip
    assert t.total == sum(line.total for line in result.lines)  # the lines add up
    assert str(t.total) == "0.437734" and all(isinstance(v, Decimal) for v in (t.total, t.gpu_seconds))
    assert (result.currency, result.prices.tier, result.prices.input_per_mtok) == (
        "usd",
        "metered",
        d("0.15"),
    )
    assert (result.start, result.end) == (T0, T0 + timedelta(hours=2))


def test_bill_is_reproducible_and_made_of_rollups_only(session_factory: sessionmaker[Session]) -> None:
    with session_scope(session_factory) as s:
        ids = seed(s)
    period: dict[str, Any] = {"tenant_id": ids["a"], "start": T0, "end": T0 + timedelta(hours=2)}
    with session_factory() as s:
        first = bill(s, **period)
    with session_scope(session_factory) as s:  # a late event, not rolled up yet: not billed
        s.add(make_event(ids["a"], T0 + timedelta(minutes=59), prompt_tokens=5_000_000))
    with session_factory() as s:
        assert bill(s, **period) == first
    with session_scope(session_factory) as s:  # rolled up: billed
        rollup_hours(s, start=T0, end=T0 + timedelta(hours=1))
    with session_factory() as s:
        again = bill(s, **period)
    assert again.lines[0].input_tokens == first.lines[0].input_tokens + 5_000_000
    assert again.totals.input_cost == first.totals.input_cost + Decimal("0.75")


def test_bill_keeps_the_settled_costs_after_a_reprice_and_only_its_tenant(
    session_factory: sessionmaker[Session],
) -> None:
    with session_scope(session_factory) as s:
        ids = seed(s)
        repo.update_tier(s, name="metered", price_input_per_mtok=0, price_cached_input_per_mtok=0,
                         price_output_per_mtok=1, price_gpu_per_second=0, currency="eur")  # fmt: skip
    with session_factory() as s:
        a_bill = bill(s, tenant_id=ids["a"], start=T0, end=T0 + timedelta(hours=2))
        b_bill = bill(s, tenant_id=ids["b"], start=T0, end=T0 + timedelta(hours=2))
        empty = bill(s, tenant_id=ids["a"], start=T0 - timedelta(days=1), end=T0)
        with pytest.raises(TenantNotFound):
            bill(s, tenant_id="ten_missing", start=T0, end=T0 + timedelta(hours=1))
        with pytest.raises(InvalidPeriod):
            bill(s, tenant_id=ids["a"], start=T0 + timedelta(minutes=1), end=T0 + timedelta(hours=1))
    # The usage was settled in usd at the first prices; the tier's eur prices are shown, not charged.
    assert (a_bill.currency, a_bill.prices.currency, a_bill.prices.output_per_mtok) == (
        "usd",
        "eur",
        Decimal(1),
    )
    assert a_bill.totals.total == Decimal("0.437734")  # as before the change
    assert [line.requests for line in b_bill.lines] == [1] and b_bill.totals.output_tokens == 9_000_000
    assert b_bill.totals.total == Decimal("7.857000")  # 9M x 0.15 + 9M x 0.6 + 9,000 s x 0.000123
    assert empty.lines == [] and empty.totals.total == 0 and str(empty.totals.total) == "0.000000"


def settled(b: pricing.Bill) -> tuple[str, list[pricing.BillLine], pricing.BillTotals]:
    """What a bill charges (its `prices` are the tier's current ones, for reference)."""
    return b.currency, b.lines, b.totals


def test_a_reprice_changes_no_earlier_bill_and_bills_equal_the_export(
    session_factory: sessionmaker[Session],
) -> None:
    """Issue 35, item 7: usage settled at the prices in force, then the tier repriced. Every earlier bill is
    unchanged (after the hours are rolled up again too), and each line's total is what the Stripe cost
    meter was sent for its rollups (the settled costs), not the quantities at the tier's current prices."""
    with session_scope(session_factory) as s:
        repo.create_tier(s, name="metered", **PRICES)
        a = repo.create_tenant(s, name="a", tier="metered").id
        support = make_adapter(s, a, "support")
        for row in s.scalars(select(PriceChange).where(PriceChange.tier == "metered")):
            row.effective_from = T0 - timedelta(days=1)  # the tier's prices were in force when it was used
        used = [
            (T0, None, Metered(1_000_000, 234_567, 200_000, 1000.1)),
            (T0 + timedelta(minutes=30), None, Metered(1_234_567, 0, 1, 0.2)),
            (T0 + timedelta(minutes=31), None, Metered(3, 0, 3, 0.3)),
            (T0 + timedelta(hours=1), None, Metered(10, 0, 0, 0.1)),
            (T0 + timedelta(minutes=1), support, Metered(3, 1, 25, 2.5)),
        ]
        for started_at, adapter_id, metered in used:  # settled as the request lifecycle settles them
            prices = prices_at(s, tenant_id=a, base_model=MODEL, adapter_id=adapter_id, at=started_at)
            s.add(make_event(a, started_at, adapter_id=adapter_id, prompt_tokens=metered.prompt_tokens,
                             cached_tokens=metered.cached_tokens, completion_tokens=metered.completion_tokens,
                             gpu_ms=metered.gpu_ms, cost=cost_of(metered, prices),
                             currency="usd"))  # fmt: skip
        s.flush()
        rollup_hours(s, start=T0, end=T0 + timedelta(hours=2))
    periods = [(T0, T0 + timedelta(hours=1)), (T0, T0 + timedelta(hours=2))]
    with session_factory() as s:
        before = [settled(bill(s, tenant_id=a, start=start, end=end)) for start, end in periods]
        exported = {
            (r.base_model, r.adapter_key, r.hour): meter_values(r)["cost"]
            for r in s.scalars(select(UsageRollup))
        }
    with session_scope(session_factory) as s:
        repo.update_tier(s, name="metered", price_input_per_mtok="9", price_cached_input_per_mtok="9",
                         price_output_per_mtok="9", price_gpu_per_second="9")  # fmt: skip
    with session_factory() as s:
        assert [settled(bill(s, tenant_id=a, start=start, end=end)) for start, end in periods] == before
    with session_scope(session_factory) as s:
        rollup_hours(s, start=T0, end=T0 + timedelta(hours=2))
    with session_factory() as s:
        assert [settled(bill(s, tenant_id=a, start=start, end=end)) for start, end in periods] == before
    for (start, end), (_, lines, totals) in zip(periods, before, strict=True):
        for line in lines:
            key = line.adapter_id or "base"
            sent = sum(
                v for (m, k, hour), v in exported.items() if (m, k) == (MODEL, key) and start <= hour < end
            )
            assert to_micros(line.total) == sent
        assert to_micros(totals.total) == sum(v for (_, _, h), v in exported.items() if start <= h < end)
    first = Prices("metered", "usd", *(Decimal(v) for v in PRICES.values()))
    assert before[1][2].total == sum(cost_of(m, first) for _, _, m in used)  # the settled costs


def test_a_bill_is_in_one_currency_and_its_lines_add_up(session_factory: sessionmaker[Session]) -> None:
    """A postpaid tenant's usage settled in usd, then in eur (its tier changed currency): a bill spanning
    both is refused naming `end`; each side is billed in its own currency. Each line's parts plus its
    adjustment are its settled total."""
    with session_scope(session_factory) as s:
        repo.create_tier(s, name="metered", **PRICES)
        a = repo.create_tenant(s, name="a", tier="metered").id
        s.add_all(
            [
                make_event(
                    a, T0, prompt_tokens=3, completion_tokens=3, cost=Decimal("0.000003"), currency="usd"
                ),
                make_event(
                    a, T0, prompt_tokens=3, completion_tokens=3, cost=Decimal("0.000003"), currency="usd"
                ),
                make_event(a, T0 + timedelta(hours=1), cost=Decimal("2.5"), currency="eur"),
            ]
        )
        s.flush()
        rollup_hours(s, start=T0, end=T0 + timedelta(hours=2))
    with session_factory() as s:
        with pytest.raises(InvalidPeriod) as refused:
            bill(s, tenant_id=a, start=T0, end=T0 + timedelta(hours=2))
        usd = bill(s, tenant_id=a, start=T0, end=T0 + timedelta(hours=1))
        eur = bill(s, tenant_id=a, start=T0 + timedelta(hours=1), end=T0 + timedelta(hours=2))
    assert refused.value.param == "end" and "eur and usd" in str(refused.value)
    assert (usd.currency, [line.currency for line in usd.lines], usd.totals.total) == (
        "usd",
        ["usd"],
        Decimal("0.000006"),
    )
    assert (eur.currency, eur.totals.total) == ("eur", Decimal("2.500000"))
    for line in [*usd.lines, *eur.lines]:
        parts = line.input_cost + line.cached_input_cost + line.output_cost + line.gpu_cost
        assert parts + line.adjustment == line.total
    # 6 input tokens at 0.15 and 6 output tokens at 0.6 a million, in one rollup: 0.000001 + 0.000004,
    # where each request settled at 0.000003 (its own roundings): the adjustment shows the micro-unit
    assert usd.lines[0].adjustment == Decimal("0.000001")
