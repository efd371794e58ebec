"""Live usage from usage_events on both backends: grouping by hour, adapter and model, adapter names, the
period's bounds, and one tenant's view never containing another's rows."""

import itertools
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from billing import repository as repo
from billing.models import Adapter, UsageEvent, utcnow
from billing.usage_queries import UsageRow, usage

T0 = datetime(2025, 3, 1, 10, 0, tzinfo=UTC)
MODEL = "tiny-llama"
_ids = itertools.count()


def make_event(tenant_id: str, started_at: datetime, **fields: Any) -> UsageEvent:
    """A metered request as the metering path writes it; token counts and gpu_ms default to small values."""
    values: dict[str, Any] = {
        "request_id": f"req-{next(_ids)}-{tenant_id}",
        "tenant_id": tenant_id,
        "key_id": "key_test",
        "model": MODEL,
        "base_model": MODEL,
        "adapter_id": None,
        "adapter_version": None,
        "status": "completed",
        "finish_reason": "stop",
        "prompt_tokens": 10,
        "cached_tokens": 0,
        "completion_tokens": 5,
        "gpu_ms": 1.5,
        "queue_ms": 0.0,
        "ttft_ms": 1.0,
        "latency_ms": 2.0,
        "replica": "replica-0",
        "started_at": started_at,
        "finished_at": started_at + timedelta(seconds=1),
        "recorded_at": utcnow(),
    }
    values.update(fields)
    if values["adapter_id"] is not None and values["adapter_version"] is None:
        values["adapter_version"] = 1
    return UsageEvent(**values)


def make_adapter(s: Session, owner: str, name: str, base_model: str = MODEL) -> str:
    adapter = Adapter(name=name, owner=owner, base_model=base_model)
    s.add(adapter)
    s.flush()
    return adapter.id


def counts(row: UsageRow) -> tuple[int, int, int, int]:
    return (row.requests, row.prompt_tokens, row.cached_tokens, row.completion_tokens)


@pytest.fixture
def s(session_factory: sessionmaker[Session]) -> Iterator[Session]:
    with session_factory() as session:
        yield session


@pytest.fixture
def world(s: Session) -> dict[str, str]:
    """Tenants a and b; a has adapter "support" (and a deleted one, "old"), b has "support" too."""
    a = repo.create_tenant(s, name="a").id
    b = repo.create_tenant(s, name="b").id
    ids = {"a": a, "b": b}
    ids["a_support"] = make_adapter(s, a, "support")
    ids["a_old"] = make_adapter(s, a, "old")
    ids["b_support"] = make_adapter(s, b, "support")
    s.get_one(Adapter, ids["a_old"]).deleted_at = utcnow()  # its name still labels its history
    s.add_all(
        [
            # a, hour 10: base x2, support x1
            make_event(a, T0, prompt_tokens=100, cached_tokens=40, completion_tokens=7, gpu_ms=1.25),
            make_event(a, T0 + timedelta(minutes=59, seconds=59), prompt_tokens=1, completion_tokens=1),
            make_event(
                a, T0 + timedelta(minutes=5), adapter_id=ids["a_support"], prompt_tokens=20, gpu_ms=2.5
            ),
            # a, hour 11: old adapter, and another base model
            make_event(a, T0 + timedelta(hours=1), adapter_id=ids["a_old"], completion_tokens=3),
            make_event(a, T0 + timedelta(hours=1, minutes=1), base_model="other", model="other"),
            # b, same hours
            make_event(b, T0, prompt_tokens=1000, completion_tokens=1000, gpu_ms=99.0),
            make_event(b, T0 + timedelta(hours=1), adapter_id=ids["b_support"], prompt_tokens=500),
            # outside [T0, T0 + 2h): just before and exactly at the end
            make_event(a, T0 - timedelta(microseconds=1), prompt_tokens=9999),
            make_event(a, T0 + timedelta(hours=2), prompt_tokens=9999),
        ]
    )
    s.flush()
    return ids


END = T0 + timedelta(hours=2)


def test_by_hour_counts_each_request_in_the_hour_it_started(s: Session, world: dict[str, str]) -> None:
    rows = usage(s, tenant_id=world["a"], start=T0, end=END, group_by="hour")
    assert [(r.hour, counts(r)) for r in rows] == [
        (T0, (3, 121, 40, 13)),
        (T0 + timedelta(hours=1), (2, 20, 0, 8)),
    ]
    assert rows[0].gpu_ms == pytest.approx(1.25 + 1.5 + 2.5)
    assert all(r.tenant_id == world["a"] and r.base_model is None and r.adapter is None for r in rows)


def test_by_adapter_names_adapters_and_calls_the_base_model_base(s: Session, world: dict[str, str]) -> None:
    rows = usage(s, tenant_id=world["a"], start=T0, end=END, group_by="adapter")
    assert [(r.base_model, r.adapter, r.adapter_id, counts(r)) for r in rows] == [
        ("other", "base", None, (1, 10, 0, 5)),
        (MODEL, "base", None, (2, 101, 40, 8)),
        (MODEL, "old", world["a_old"], (1, 10, 0, 3)),  # deleted since: still named
        (MODEL, "support", world["a_support"], (1, 20, 0, 5)),
    ]
    assert all(r.hour is None for r in rows)


def test_by_model(s: Session, world: dict[str, str]) -> None:
    rows = usage(s, tenant_id=world["a"], start=T0, end=END, group_by="model")
    assert [(r.base_model, counts(r)) for r in rows] == [("other", (1, 10, 0, 5)), (MODEL, (4, 131, 40, 16))]


@pytest.mark.parametrize("group_by", ["hour", "adapter", "model", "batch"])
def test_a_tenant_sees_only_its_own_rows(s: Session, world: dict[str, str], group_by: Any) -> None:
    for me, other in (("a", "b"), ("b", "a")):
        rows = usage(s, tenant_id=world[me], start=T0, end=END, group_by=group_by)
        assert rows and {r.tenant_id for r in rows} == {world[me]}
        assert world[f"{other}_support"] not in {r.adapter_id for r in rows}
    b_total = sum(r.requests for r in usage(s, tenant_id=world["b"], start=T0, end=END, group_by=group_by))
    assert b_total == 2


def test_across_tenants_every_row_names_its_tenant(s: Session, world: dict[str, str]) -> None:
    rows = usage(s, tenant_id=None, start=T0, end=END, group_by="adapter")
    by_tenant = {(r.tenant_id, r.base_model, r.adapter): r.requests for r in rows}
    assert by_tenant == {
        (world["a"], "other", "base"): 1,
        (world["a"], MODEL, "base"): 2,
        (world["a"], MODEL, "old"): 1,
        (world["a"], MODEL, "support"): 1,
        (world["b"], MODEL, "base"): 1,
        (world["b"], MODEL, "support"): 1,
    }
    assert [r.tenant_id for r in rows] == sorted(r.tenant_id for r in rows)  # grouped by tenant
    hours = usage(s, tenant_id=None, start=T0, end=END, group_by="hour")
    a, b, t1 = world["a"], world["b"], T0 + timedelta(hours=1)
    assert [(r.tenant_id, r.hour, r.requests) for r in hours] == sorted(
        [(a, T0, 3), (a, t1, 2), (b, T0, 1), (b, t1, 1)]
    )


def test_the_period_is_half_open_and_live(s: Session, world: dict[str, str]) -> None:
    """[start, end): the event at end is out, the one a microsecond before start too. No rollup is needed."""
    assert (
        usage(s, tenant_id=world["a"], start=END, end=END + timedelta(hours=1), group_by="model")[0].requests
        == 1
    )
    narrow = usage(
        s, tenant_id=world["a"], start=T0 + timedelta(minutes=1), end=T0 + timedelta(hours=1), group_by="hour"
    )
    assert [(r.hour, r.requests) for r in narrow] == [(T0, 2)]  # 10:05 and 10:59:59
    assert usage(s, tenant_id="ten_nobody", start=T0, end=END, group_by="hour") == []


def test_naive_times_are_utc_and_unknown_grouping_is_refused(s: Session, world: dict[str, str]) -> None:
    naive = usage(
        s, tenant_id=world["a"], start=T0.replace(tzinfo=None), end=END.replace(tzinfo=None), group_by="model"
    )
    assert naive == usage(s, tenant_id=world["a"], start=T0, end=END, group_by="model")
    with pytest.raises(ValueError, match="group_by"):
        usage(s, tenant_id=world["a"], start=T0, end=END, group_by="day")  # type: ignore[arg-type]
