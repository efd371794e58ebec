"""The load test's tenants: `loraplex up`'s preparation, then tenants on four tiers, keys, closed-hour
usage for the Stripe export, and the plan bench/locustfile.py's users read."""

import contextlib
import json
import sys
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from app.modelprep.demo_skills import SKILLS
from bench.load.options import MODEL, SEED_PREFIX, STRIPE_CUSTOMERS
from bench.load.platform import Platform


@dataclass
class TenantSetup:
    name: str
    tier: str
    tenant_id: str
    key: str
    users: int
    limited: bool


# name, tier, Tier fields (None: a seeded tier), users, limited (has limits, so its 429s are intended)
TENANTS: tuple[tuple[str, str, dict[str, Any] | None, int, bool], ...] = (
    ("bench-ent", "enterprise", None, 3, False),
    ("bench-pro", "pro", None, 2, True),  # on_limit=queue: bursts wait up to 5 s
    ("bench-free", "free", None, 2, True),
    # One user, one request at a time: rpm 15 needed a request every 3 s, which a busy CI machine under
    # faults did not reach (no 429 in 45 s); 4 a minute is reached at any pace this test serves.
    ("bench-tight", "bench-tight", {"rpm": 4, "max_concurrent": 2, "on_limit": "reject"}, 1, True),
    # Prepaid, on a priced tier: every request reserves its worst case and settles through the faults.
    (
        "bench-credit",
        "bench-metered",
        {"price_input_per_mtok": "20", "price_output_per_mtok": "60"},
        1,
        False,
    ),
)
CREDITED = {"bench-credit": "100"}  # USD of prepaid credit: far more than 45 s of load spends


def prepare(platform: Platform, config: Path, users: int) -> list[TenantSetup]:
    """`loraplex up`'s preparation (app.demo.prepare), then our tenants, keys and closed-hour usage."""
    from pydantic import SecretStr

    from app.auth.api_keys import generate_key
    from app.demo import prepare as prepare_demo
    from app.settings import Settings
    from billing import adapter_registry, credit, repository
    from billing.db import make_engine, make_session_factory, session_scope
    from billing.models import PUBLIC_OWNER

    settings = Settings(
        data_dir=platform.data_dir,
        database_url=platform.database_url,
        admin_key=SecretStr(platform.admin_key),
        key_secret=SecretStr(platform.key_secret),
        adapter_store=platform.data_dir / "adapters",
    )
    with contextlib.redirect_stdout(sys.stderr):  # import banners must not mix with the report
        prepare_demo(settings, config)
    engine = make_engine(platform.database_url)
    sessions = make_session_factory(engine)
    tenants: list[TenantSetup] = []
    weights = _user_split(users, [t[3] for t in TENANTS])
    with session_scope(sessions) as session:
        for (name, tier, tier_fields, _, limited), n_users in zip(TENANTS, weights, strict=True):
            if tier_fields is not None:
                repository.create_tier(session, name=tier, description="load test: tight", **tier_fields)
            tenant = repository.create_tenant(session, name=name, tier=tier)
            if name in STRIPE_CUSTOMERS:
                repository.update_tenant(
                    session, tenant_id=tenant.id, stripe_customer_id=STRIPE_CUSTOMERS[name]
                )
            key = generate_key(settings.resolved_key_secret())
            repository.create_api_key(session, tenant_id=tenant.id, prefix=key.prefix, key_hash=key.hash,
                                      name="load-test")  # fmt: skip
            if name in CREDITED:
                credit.add_credit(session, tenant_id=tenant.id, amount=CREDITED[name], kind="topup",
                                  reason="load test", actor="load-test")  # fmt: skip
            tenants.append(TenantSetup(name, tier, tenant.id, key.plaintext, n_users, limited))
        sql_adapter = adapter_registry.find_live(session, owner=PUBLIC_OWNER, name="demo-sql")
        adapter_id = None if sql_adapter is None else sql_adapter.id
    _seed_closed_hours(sessions, [t for t in tenants if t.name in STRIPE_CUSTOMERS], adapter_id)
    engine.dispose()
    return tenants


def _user_split(users: int, weights: list[int]) -> list[int]:
    """`users` spread over the tenants by weight, at least one each (so every tier sees traffic)."""
    total = sum(weights)
    split = [max(1, round(users * w / total)) for w in weights]
    while sum(split) > max(users, len(weights)):
        split[len(split) - 1 - split[::-1].index(max(split))] -= 1  # the later (smaller) tenants give
    return split


def _seed_closed_hours(sessions: Any, tenants: list[TenantSetup], adapter_id: str | None) -> None:
    """Usage two and three hours back (closed hours: the only ones the Stripe export sends), so the
    export has events to deliver while the stub fails. Marked by their request ids."""
    from billing.db import session_scope
    from billing.usage import UsageRecord, closed_before, hour_of, record_usage, rollup_hours

    now = datetime.now(UTC)
    records = []
    for tenant in tenants:
        for back in (2, 3):
            for adapter in (None, adapter_id):
                for minute in (5, 35):
                    started = hour_of(now) - timedelta(hours=back) + timedelta(minutes=minute)
                    records.append(UsageRecord(
                        request_id=f"{SEED_PREFIX}{uuid.uuid4().hex}", tenant_id=tenant.tenant_id,
                        key_id="seed", model="public/demo-sql" if adapter else MODEL, base_model=MODEL,
                        adapter_id=adapter, adapter_version=1 if adapter else None, status="completed",
                        finish_reason="length", prompt_tokens=40 + back + minute, cached_tokens=8,
                        completion_tokens=12 + back, gpu_ms=25.5 * back, queue_ms=1.0, ttft_ms=5.0,
                        latency_ms=50.0, replica=None, started_at=started,
                        finished_at=started + timedelta(seconds=1),
                    ))  # fmt: skip
    with session_scope(sessions) as session:
        record_usage(session, records)
        rollup_hours(session, start=now - timedelta(hours=6), end=closed_before(now))


def write_plan(platform: Platform, tenants: list[TenantSetup]) -> Path:
    models = [MODEL, *(f"public/{skill.name}" for skill in SKILLS)]  # what `loraplex up` registered
    plan = {
        "tenants": [
            {"name": t.name, "tenant_id": t.tenant_id, "key": t.key, "users": t.users, "limited": t.limited}
            for t in tenants
        ],
        "models": models,
        "max_tokens": [2, 12],
    }
    path = platform.workdir / "plan.json"
    path.write_text(json.dumps(plan, indent=2))
    path.chmod(0o600)  # it holds API keys
    return path
