"""Repository behaviour on both backends: what an admin or the auth path would notice."""

import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.exc import StatementError
from sqlalchemy.orm import Session, sessionmaker

from app.auth.api_keys import generate_key, verify_key
from billing import repository as repo
from billing.db import session_scope
from billing.errors import ApiKeyNotFound, TenantNameTaken, TenantNotFound, TierExists, TierNotFound
from billing.models import ApiKey, Tenant, TenantStatus

SECRET = b"test-server-secret"
ID_RE = re.compile(r"^(ten|key)_[a-z2-7]{20}$")


@pytest.fixture
def s(session_factory: sessionmaker[Session]) -> Iterator[Session]:
    with session_factory() as session:
        yield session


def add_key(
    s: Session, tenant_id: str, *, name: str | None = None, expires_at: datetime | None = None
) -> ApiKey:
    new = generate_key(SECRET)
    return repo.create_api_key(
        s, tenant_id=tenant_id, prefix=new.prefix, key_hash=new.hash, name=name, expires_at=expires_at
    )


# Tiers


def test_tiers_are_listed_by_name_after_the_seeded_tiers(s: Session) -> None:
    assert [t.name for t in repo.list_tiers(s)] == ["enterprise", "free", "pro"]
    pro = repo.create_tier(s, name="gold", description="Paid")
    repo.create_tier(s, name="basic")
    assert [t.name for t in repo.list_tiers(s)] == ["basic", "enterprise", "free", "gold", "pro"]
    assert repo.get_tier(s, name="basic").description == ""
    assert repo.get_tier(s, name="gold") is pro
    assert pro.created_at.tzinfo is UTC


def test_tier_errors_name_the_tier(s: Session) -> None:
    with pytest.raises(TierExists, match="'free'"):
        repo.create_tier(s, name="free")
    with pytest.raises(TierNotFound, match="'gold'"):
        repo.get_tier(s, name="gold")


# Tenants


def test_create_tenant_defaults(s: Session) -> None:
    before = datetime.now(UTC)
    tenant = repo.create_tenant(s, name="acme")
    assert ID_RE.match(tenant.id)
    assert tenant.id.startswith("ten_")
    assert (tenant.tier, tenant.status, tenant.disabled_at) == ("free", TenantStatus.ACTIVE, None)
    assert before <= tenant.created_at == tenant.updated_at <= datetime.now(UTC)
    assert repo.get_tenant(s, tenant_id=tenant.id) is tenant
    assert repo.create_tenant(s, name="other").id != tenant.id


def test_tenant_errors_name_the_value(s: Session) -> None:
    with pytest.raises(TierNotFound, match="'gold'"):
        repo.create_tenant(s, name="acme", tier="gold")
    with pytest.raises(TenantNotFound, match="'ten_missing'"):
        repo.get_tenant(s, tenant_id="ten_missing")
    with pytest.raises(TenantNotFound):
        repo.update_tenant(s, tenant_id="ten_missing", name="x")
    with pytest.raises(TenantNotFound):
        repo.disable_tenant(s, tenant_id="ten_missing")
    assert repo.list_tenants(s) == []


def test_tenant_names_are_unique_and_case_sensitive(s: Session) -> None:
    repo.create_tenant(s, name="Acme")
    with pytest.raises(TenantNameTaken, match="'Acme'"):
        repo.create_tenant(s, name="Acme")
    assert repo.create_tenant(s, name="acme").name == "acme"


def test_list_tenants_in_creation_order_with_or_without_disabled(s: Session) -> None:
    a, b, c = (repo.create_tenant(s, name=name) for name in ("c-first", "b-second", "a-third"))
    repo.disable_tenant(s, tenant_id=b.id)
    assert repo.list_tenants(s) == [a, b, c]
    assert repo.list_tenants(s, include_disabled=False) == [a, c]


def test_update_tenant_renames_and_moves_tier(s: Session) -> None:
    repo.create_tier(s, name="gold")
    tenant = repo.create_tenant(s, name="acme")
    taken = repo.create_tenant(s, name="taken")
    created, first_update = tenant.created_at, tenant.updated_at

    assert repo.update_tenant(s, tenant_id=tenant.id) is tenant  # nothing asked, nothing changed
    repo.update_tenant(s, tenant_id=tenant.id, tier="gold")
    assert (tenant.name, tenant.tier) == ("acme", "gold")
    repo.update_tenant(s, tenant_id=tenant.id, name="acme")  # its own name is not "taken"
    repo.update_tenant(s, tenant_id=tenant.id, name="acme-2")
    assert (tenant.name, tenant.tier) == ("acme-2", "gold")
    assert tenant.created_at == created
    assert tenant.updated_at > first_update

    with pytest.raises(TenantNameTaken, match="'taken'"):
        repo.update_tenant(s, tenant_id=tenant.id, name=taken.name)
    with pytest.raises(TierNotFound, match="'platinum'"):
        repo.update_tenant(s, tenant_id=tenant.id, tier="platinum")
    assert (tenant.name, tenant.tier) == ("acme-2", "gold")


def test_renaming_a_tier_cascades_to_its_tenants(session_factory: sessionmaker[Session]) -> None:
    with session_scope(session_factory) as s:
        repo.create_tier(s, name="gold")
        tenant_id = repo.create_tenant(s, name="acme", tier="gold").id
    with session_scope(session_factory) as s:  # ON UPDATE CASCADE: tiers may be renamed later
        s.execute(text("UPDATE tiers SET name = 'gold-2024' WHERE name = 'gold'"))
    with session_factory() as s:
        assert repo.get_tenant(s, tenant_id=tenant_id).tier == "gold-2024"


def test_disable_tenant_revokes_its_keys_and_is_idempotent(s: Session) -> None:
    tenant, bystander = repo.create_tenant(s, name="acme"), repo.create_tenant(s, name="bystander")
    live, early = add_key(s, tenant.id), add_key(s, tenant.id)
    other = add_key(s, bystander.id)
    first_revocation = repo.revoke_api_key(s, key_id=early.id).revoked_at
    now = datetime.now(UTC)
    assert repo.find_active_key(s, prefix=live.prefix, now=now) == (live, tenant)

    repo.disable_tenant(s, tenant_id=tenant.id)
    assert tenant.status == TenantStatus.DISABLED
    assert tenant.disabled_at is not None
    assert live.revoked_at == tenant.disabled_at
    assert early.revoked_at == first_revocation
    assert repo.find_active_key(s, prefix=live.prefix, now=now) is None
    assert repo.find_active_key(s, prefix=other.prefix, now=now) == (other, bystander)
    with pytest.raises(TenantNotFound):  # a disabled tenant takes no new keys
        add_key(s, tenant.id)

    disabled_at = tenant.disabled_at
    repo.disable_tenant(s, tenant_id=tenant.id)
    assert tenant.disabled_at == disabled_at
    assert live.revoked_at == disabled_at


def test_rows_are_never_deleted(session_factory: sessionmaker[Session]) -> None:
    with session_scope(session_factory) as s:
        tenant = repo.create_tenant(s, name="acme")
        key_ids = {add_key(s, tenant.id).id for _ in range(3)}
    with session_scope(session_factory) as s:
        repo.revoke_api_key(s, key_id=next(iter(key_ids)))
        repo.disable_tenant(s, tenant_id=tenant.id)
    with session_factory() as s:
        assert s.scalar(select(func.count()).select_from(Tenant)) == 1
        assert {k.id for k in repo.list_api_keys(s, tenant_id=tenant.id)} == key_ids
        assert all(k.revoked_at is not None for k in repo.list_api_keys(s, tenant_id=tenant.id))


# API keys


def test_keys_from_app_auth_authenticate(s: Session) -> None:
    tenant = repo.create_tenant(s, name="acme")
    new = generate_key(SECRET)
    key = repo.create_api_key(s, tenant_id=tenant.id, prefix=new.prefix, key_hash=new.hash, name="ci")
    assert ID_RE.match(key.id)
    assert key.id.startswith("key_")
    assert (key.name, key.expires_at, key.revoked_at, key.last_used_at) == ("ci", None, None, None)

    found = repo.find_active_key(s, prefix=new.prefix, now=datetime.now(UTC))
    assert found == (key, tenant)
    assert verify_key(SECRET, new.plaintext, found[0].key_hash)
    assert not verify_key(SECRET, generate_key(SECRET).plaintext, found[0].key_hash)


def test_keys_for_unknown_tenants_are_refused_before_the_database(s: Session) -> None:
    with pytest.raises(TenantNotFound, match="'ten_missing'"):
        add_key(s, "ten_missing")
    assert s.scalar(select(func.count()).select_from(ApiKey)) == 0


def test_list_and_get_api_keys(s: Session) -> None:
    tenant, other = repo.create_tenant(s, name="acme"), repo.create_tenant(s, name="other")
    keys = [add_key(s, tenant.id, name=f"k{i}") for i in range(3)]
    add_key(s, other.id)
    repo.revoke_api_key(s, key_id=keys[1].id)
    assert repo.list_api_keys(s, tenant_id=tenant.id) == keys  # revoked ones too, oldest first
    assert repo.get_api_key(s, key_id=keys[2].id) is keys[2]
    with pytest.raises(ApiKeyNotFound, match="'key_missing'"):
        repo.get_api_key(s, key_id="key_missing")
    with pytest.raises(TenantNotFound):
        repo.list_api_keys(s, tenant_id="ten_missing")


def test_revoke_is_idempotent_and_keeps_the_first_time(s: Session) -> None:
    key = add_key(s, repo.create_tenant(s, name="acme").id)
    first = repo.revoke_api_key(s, key_id=key.id).revoked_at
    assert first is not None
    assert repo.revoke_api_key(s, key_id=key.id).revoked_at == first
    assert repo.find_active_key(s, prefix=key.prefix, now=datetime.now(UTC)) is None
    with pytest.raises(ApiKeyNotFound):
        repo.revoke_api_key(s, key_id="key_missing")


def test_find_active_key_honours_expiry(s: Session) -> None:
    tenant = repo.create_tenant(s, name="acme")
    expiry = datetime(2030, 1, 1, tzinfo=UTC)
    key = add_key(s, tenant.id, expires_at=expiry)
    just_before = expiry - timedelta(microseconds=1)
    assert repo.find_active_key(s, prefix=key.prefix, now=just_before) == (key, tenant)
    assert repo.find_active_key(s, prefix=key.prefix, now=expiry) is None  # expires_at is exclusive
    assert repo.find_active_key(s, prefix=key.prefix, now=expiry + timedelta(days=1)) is None
    # Same instant in another zone: compared as instants, not as wall-clock text.
    tokyo = timezone(timedelta(hours=9))
    assert repo.find_active_key(s, prefix=key.prefix, now=just_before.astimezone(tokyo)) == (key, tenant)
    assert repo.find_active_key(s, prefix=key.prefix, now=expiry.astimezone(tokyo)) is None
    assert repo.find_active_key(s, prefix="unknownprefx", now=just_before) is None


def test_touch_key_records_use_and_never_goes_back(s: Session) -> None:
    key = add_key(s, repo.create_tenant(s, name="acme").id)
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    repo.touch_key(s, key_id=key.id, now=t0)
    assert key.last_used_at == t0
    repo.touch_key(s, key_id=key.id, now=t0 - timedelta(seconds=5))  # a late report from another replica
    assert key.last_used_at == t0
    repo.touch_key(s, key_id=key.id, now=t0 + timedelta(seconds=5))
    assert key.last_used_at == t0 + timedelta(seconds=5)
    with pytest.raises(ApiKeyNotFound):
        repo.touch_key(s, key_id="key_missing", now=t0)


def test_datetimes_round_trip_as_aware_utc(session_factory: sessionmaker[Session], database_url: str) -> None:
    india = timezone(timedelta(hours=5, minutes=30))
    expires = datetime(2030, 6, 1, 12, 0, 0, 123456, tzinfo=india)
    with session_scope(session_factory) as s:
        key_id = add_key(s, repo.create_tenant(s, name="acme").id, expires_at=expires).id
    with session_factory() as s:
        key = repo.get_api_key(s, key_id=key_id)
        assert key.expires_at == expires
        assert key.expires_at.tzinfo is UTC
        assert (key.expires_at.hour, key.expires_at.minute, key.expires_at.microsecond) == (6, 30, 123456)
        assert key.created_at.tzinfo is UTC
        if database_url.startswith("sqlite"):  # stored as UTC text, no offset
            stored = s.scalar(text("SELECT expires_at FROM api_keys"))
            assert stored == "2030-06-01 06:30:00.123456"


def test_naive_datetimes_are_refused(s: Session) -> None:
    tenant = repo.create_tenant(s, name="acme")
    with pytest.raises(StatementError, match="naive datetime"):
        repo.find_active_key(s, prefix="whatever1234", now=datetime(2030, 1, 1))
    with pytest.raises(StatementError, match="naive datetime"):
        add_key(s, tenant.id, expires_at=datetime(2030, 1, 1))
