"""Tiers' rate limits and tenants' overrides in the repository, on both backends: create, partial update,
None as unlimited (or "no override"), and validation that names the field and writes nothing."""

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from app.auth.authenticator import limits_for
from app.limits import Limits
from billing import repository as repo
from billing.db import session_scope
from billing.errors import InvalidLimits, TenantNotFound, TierExists, TierNotFound

INT32_MAX = 2**31 - 1


@pytest.fixture
def s(session_factory: sessionmaker[Session]) -> Iterator[Session]:
    with session_factory() as session:
        yield session


def limits_of(tier: Any) -> tuple[Any, ...]:
    return (tier.rpm, tier.tpm, tier.max_concurrent, tier.max_tokens_cap, tier.on_limit, tier.max_queue_ms)


def test_create_tier_with_limits_round_trips(session_factory: sessionmaker[Session]) -> None:
    with session_scope(session_factory) as s:
        repo.create_tier(
            s,
            name="gold",
            description="Paid",
            rpm=120,
            tpm=5_000_000_000,  # tpm is a BIGINT
            max_concurrent=16,
            max_tokens_cap=2048,
            on_limit="queue",
            max_queue_ms=60_000,
        )
    with session_factory() as s:
        gold = repo.get_tier(s, name="gold")
        assert limits_of(gold) == (120, 5_000_000_000, 16, 2048, "queue", 60_000)
        assert gold.description == "Paid"


def test_create_tier_defaults_to_unlimited_and_reject(s: Session) -> None:
    """Existing callers (name, description) keep working: such a tier limits nothing."""
    basic = repo.create_tier(s, name="basic")
    assert limits_of(basic) == (None, None, None, None, "reject", 0)
    assert basic.description == ""
    with pytest.raises(TierExists, match="'basic'"):
        repo.create_tier(s, name="basic", rpm=5)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"rpm": 0}, "rpm"),
        ({"tpm": -1}, "tpm"),
        ({"max_concurrent": True}, "max_concurrent"),
        ({"max_tokens_cap": 1.5}, "max_tokens_cap"),
        ({"rpm": "60"}, "rpm"),
        ({"rpm": INT32_MAX + 1}, "rpm"),
        ({"on_limit": "drop"}, "on_limit"),
        ({"on_limit": "queue"}, "max_queue_ms"),  # queueing for 0 ms
        ({"on_limit": "queue", "max_queue_ms": 0}, "max_queue_ms"),
        ({"max_queue_ms": -1}, "max_queue_ms"),
        ({"max_queue_ms": 60_001}, "max_queue_ms"),
    ],
)
def test_invalid_limits_are_refused_naming_the_field(s: Session, changes: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidLimits) as created:
        repo.create_tier(s, name="bad", **changes)
    assert created.value.field == field
    assert str(created.value).startswith(f"{field} must be ")
    assert repr(changes.get(field, 0)) in str(created.value)
    with pytest.raises(TierNotFound):
        repo.get_tier(s, name="bad")  # nothing written

    with pytest.raises(InvalidLimits) as updated:
        repo.update_tier(s, name="free", **changes)
    assert updated.value.field == field
    assert limits_of(repo.get_tier(s, name="free")) == (60, 100_000, 8, 4096, "reject", 0)  # the seed


def test_update_tier_changes_only_what_is_given(session_factory: sessionmaker[Session]) -> None:
    with session_scope(session_factory) as s:
        repo.create_tier(s, name="gold", description="Paid", rpm=100, tpm=1000, max_concurrent=4)
    with session_scope(session_factory) as s:
        tier = repo.update_tier(s, name="gold", rpm=200)
        assert limits_of(tier) == (200, 1000, 4, None, "reject", 0)
        assert repo.update_tier(s, name="gold") is tier  # nothing given, nothing changed
    with session_scope(session_factory) as s:
        repo.update_tier(s, name="gold", tpm=None, max_tokens_cap=512, description="Paid, monthly")
    with session_factory() as s:
        gold = repo.get_tier(s, name="gold")
        assert limits_of(gold) == (200, None, 4, 512, "reject", 0)  # tpm now unlimited
        assert gold.description == "Paid, monthly"


def test_switching_a_tier_to_queue_needs_a_queue_time(s: Session) -> None:
    repo.update_tier(s, name="free", on_limit="queue", max_queue_ms=250)
    assert limits_of(repo.get_tier(s, name="free"))[4:] == ("queue", 250)
    repo.update_tier(s, name="free", max_queue_ms=1000)  # checked against the tier's on_limit
    with pytest.raises(InvalidLimits, match="max_queue_ms must be more than 0 when on_limit is 'queue'"):
        repo.update_tier(s, name="free", max_queue_ms=0)
    repo.update_tier(s, name="free", on_limit="reject", max_queue_ms=0)
    assert limits_of(repo.get_tier(s, name="free"))[4:] == ("reject", 0)


def test_a_seeded_tier_can_be_made_unlimited(s: Session) -> None:
    repo.update_tier(s, name="pro", rpm=None, tpm=None, max_concurrent=None, max_tokens_cap=None)
    assert limits_of(repo.get_tier(s, name="pro")) == (None, None, None, None, "queue", 5000)


def test_update_unknown_tier(s: Session) -> None:
    with pytest.raises(TierNotFound, match="'platinum'"):
        repo.update_tier(s, name="platinum", rpm=1)


def test_tenant_overrides_set_and_clear(session_factory: sessionmaker[Session]) -> None:
    with session_scope(session_factory) as s:
        tenant_id = repo.create_tenant(s, name="acme").id
    with session_scope(session_factory) as s:
        tenant = repo.update_tenant_limits(s, tenant_id=tenant_id, rpm=2, max_tokens_cap=16)
        assert (tenant.rpm, tenant.tpm, tenant.max_concurrent, tenant.max_tokens_cap) == (2, None, None, 16)
    with session_factory() as s:
        tenant = repo.get_tenant(s, tenant_id=tenant_id)
        free = repo.get_tier(s, name="free")
        assert limits_for(free, tenant) == Limits(rpm=2, tpm=100_000, max_concurrent=8, max_tokens_cap=16)
    with session_scope(session_factory) as s:
        repo.update_tenant_limits(s, tenant_id=tenant_id, rpm=None)  # clear one, keep the other
    with session_factory() as s:
        tenant = repo.get_tenant(s, tenant_id=tenant_id)
        assert (tenant.rpm, tenant.max_tokens_cap) == (None, 16)
        assert limits_for(repo.get_tier(s, name="free"), tenant).rpm == 60  # the tier's again


def test_tenant_override_updates_updated_at_only_on_change(s: Session) -> None:
    tenant = repo.create_tenant(s, name="acme")
    created = tenant.updated_at
    repo.update_tenant_limits(s, tenant_id=tenant.id)
    repo.update_tenant_limits(s, tenant_id=tenant.id, rpm=None)  # already none: no change
    assert tenant.updated_at == created
    repo.update_tenant_limits(s, tenant_id=tenant.id, tpm=10)
    assert tenant.updated_at > created


@pytest.mark.parametrize(
    ("overrides", "field"),
    [({"rpm": 0}, "rpm"), ({"tpm": 2**63}, "tpm"), ({"max_concurrent": -5}, "max_concurrent")],
)
def test_invalid_overrides_write_nothing(s: Session, overrides: dict[str, Any], field: str) -> None:
    tenant = repo.create_tenant(s, name="acme")
    with pytest.raises(InvalidLimits) as error:
        repo.update_tenant_limits(s, tenant_id=tenant.id, max_tokens_cap=10, **overrides)
    assert error.value.field == field
    assert tenant.max_tokens_cap is None  # the valid part was not applied either


def test_overrides_of_an_unknown_tenant(s: Session) -> None:
    with pytest.raises(TenantNotFound):
        repo.update_tenant_limits(s, tenant_id="ten_nosuchtenant", rpm=1)
