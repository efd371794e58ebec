"""Budgets and credit (issue 29): the prepaid credit ledger, spend limits, budget events, effective-dated
prices, and each usage row's cost fixed at settlement.

Existing data: every tier's current prices become its first price row, in force since 1970 (the only
prices there ever were that we know of), and each existing usage row is priced at them once, now.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-27
"""

from collections.abc import Sequence
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Context, Decimal

import sqlalchemy as sa
from alembic import context, op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SINCE = datetime(1970, 1, 1, tzinfo=UTC)
_EXACT = Context(prec=60, rounding=ROUND_HALF_EVEN)
_STEP = Decimal("0.000001")


def upgrade() -> None:
    op.add_column("tenants", sa.Column("prepaid", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.add_column("usage_events", sa.Column("cost", sa.Numeric(18, 6), nullable=True))
    op.add_column("usage_events", sa.Column("currency", sa.String(3), nullable=True))
    op.create_table(
        "credit_entries",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("amount", sa.Numeric(18, 6), nullable=False),
        sa.Column("currency", sa.String(3), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_credit_entries")),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_credit_entries_tenant_id_tenants")),
        sa.CheckConstraint("kind IN ('topup', 'adjustment')", name=op.f("ck_credit_entries_kind")),
    )
    op.create_index(op.f("ix_credit_entries_tenant_id"), "credit_entries", ["tenant_id"])
    op.create_table(
        "spend_limits",
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("period", sa.String(8), nullable=False),
        sa.Column("amount", sa.Numeric(18, 6), nullable=False),
        sa.Column("hard", sa.Boolean(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "period", name=op.f("pk_spend_limits")),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_spend_limits_tenant_id_tenants")),
        sa.CheckConstraint("period IN ('day', 'month')", name=op.f("ck_spend_limits_period")),
    )
    op.create_table(
        "budget_events",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("period_key", sa.String(16), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_budget_events")),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_budget_events_tenant_id_tenants")),
        sa.UniqueConstraint("tenant_id", "period_key", "kind", name=op.f("uq_budget_events_once")),
    )
    op.create_index(op.f("ix_budget_events_tenant_id"), "budget_events", ["tenant_id"])
    prices = op.create_table(
        "price_changes",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("tier", sa.String(64), nullable=True),
        sa.Column("tenant_id", sa.String(32), nullable=True),
        sa.Column("base_model", sa.String(128), nullable=True),
        sa.Column("adapter_id", sa.String(32), nullable=True),
        sa.Column("effective_from", sa.DateTime(timezone=True), nullable=False),
        sa.Column("input_per_mtok", sa.Numeric(18, 6), nullable=False),
        sa.Column("cached_input_per_mtok", sa.Numeric(18, 6), nullable=False),
        sa.Column("output_per_mtok", sa.Numeric(18, 6), nullable=False),
        sa.Column("gpu_per_second", sa.Numeric(18, 6), nullable=False),
        sa.Column("currency", sa.String(3), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_price_changes")),
    )
    op.create_index("ix_price_changes_scope", "price_changes", ["tier", "tenant_id", "effective_from"])
    if not context.is_offline_mode():
        _backfill(prices)


def _backfill(prices: sa.Table) -> None:
    """Each tier's prices as its first price row; each usage row priced at its tenant's tier's."""
    bind = op.get_bind()
    tiers = sa.table(
        "tiers", *(sa.column(n) for n in ("name", "price_input_per_mtok", "price_cached_input_per_mtok",
                                           "price_output_per_mtok", "price_gpu_per_second", "currency"))
    )  # fmt: skip
    now = datetime.now(UTC)
    by_tier: dict[str, tuple[Decimal, Decimal, Decimal, Decimal, str]] = {}
    for row in bind.execute(sa.select(tiers)).all():
        values = tuple(Decimal(str(v)) for v in row[1:5])
        by_tier[row[0]] = (*values, row[5])
        op.bulk_insert(prices, [{
            "id": f"prc_tier_{row[0]}"[:32], "tier": row[0], "effective_from": SINCE, "input_per_mtok": values[0],
            "cached_input_per_mtok": values[1], "output_per_mtok": values[2], "gpu_per_second": values[3],
            "currency": row[5], "created_at": now,
        }])  # fmt: skip
    events = sa.table(
        "usage_events", *(sa.column(n) for n in ("request_id", "tenant_id", "prompt_tokens", "cached_tokens",
                                                  "completion_tokens", "gpu_ms", "cost", "currency"))
    )  # fmt: skip
    tenants = sa.table("tenants", sa.column("id"), sa.column("tier"))
    tier_of = dict(bind.execute(sa.select(tenants.c.id, tenants.c.tier)).tuples().all())
    for row in bind.execute(sa.select(events).where(events.c.cost.is_(None))).all():
        tier = by_tier.get(tier_of.get(row.tenant_id, ""))
        if tier is None:
            continue
        price_in, price_cached, price_out, price_gpu, currency = tier
        cost = _cost(row.prompt_tokens - row.cached_tokens, row.cached_tokens, row.completion_tokens,
                     Decimal(repr(float(row.gpu_ms))), price_in, price_cached, price_out, price_gpu)  # fmt: skip
        bind.execute(
            events.update().where(events.c.request_id == row.request_id).values(cost=cost, currency=currency)
        )


def _cost(
    uncached: int, cached: int, output: int, gpu_ms: Decimal, *prices: Decimal
) -> Decimal:
    """billing.price_book's arithmetic, frozen here as of this revision (a migration must not change when
    the code does): each part rounded once to 6 decimals, half to even, then summed."""
    million = Decimal(1_000_000)
    seconds = (gpu_ms / 1000).quantize(_STEP, context=_EXACT)
    parts = (Decimal(uncached) * prices[0] / million, Decimal(cached) * prices[1] / million,
             Decimal(output) * prices[2] / million, seconds * prices[3])  # fmt: skip
    return sum((_EXACT.multiply(p, 1).quantize(_STEP, context=_EXACT) for p in parts), Decimal("0.000000"))


def downgrade() -> None:
    op.drop_index("ix_price_changes_scope", table_name="price_changes")
    op.drop_table("price_changes")
    op.drop_index(op.f("ix_budget_events_tenant_id"), table_name="budget_events")
    op.drop_table("budget_events")
    op.drop_table("spend_limits")
    op.drop_index(op.f("ix_credit_entries_tenant_id"), table_name="credit_entries")
    op.drop_table("credit_entries")
    with op.batch_alter_table("usage_events", copy_from=_usage_events_0006()) as batch:
        batch.drop_column("currency")
        batch.drop_column("cost")
    with op.batch_alter_table("tenants", copy_from=_tenants_0006()) as batch:
        batch.drop_column("prepaid")


def _tenants_0006() -> sa.Table:
    """tenants as this revision leaves it (SQLite rebuilds the table to drop a column)."""
    return sa.Table(
        "tenants",
        sa.MetaData(),
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("tier", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("disabled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("rpm", sa.Integer(), nullable=True),
        sa.Column("tpm", sa.BigInteger(), nullable=True),
        sa.Column("max_concurrent", sa.Integer(), nullable=True),
        sa.Column("max_tokens_cap", sa.Integer(), nullable=True),
        sa.Column("stripe_customer_id", sa.String(64), nullable=True),
        sa.Column("prepaid", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.PrimaryKeyConstraint("id", name="pk_tenants"),
        sa.UniqueConstraint("name", name="uq_tenants_name"),
        sa.ForeignKeyConstraint(["tier"], ["tiers.name"], name="fk_tenants_tier_tiers", onupdate="CASCADE"),
        sa.CheckConstraint("status IN ('active', 'disabled')", name="ck_tenants_status"),
    )


def _usage_events_0006() -> sa.Table:
    return sa.Table(
        "usage_events",
        sa.MetaData(),
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("base_model", sa.String(128), nullable=False),
        sa.Column("adapter_id", sa.String(32), nullable=True),
        sa.Column("adapter_version", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("finish_reason", sa.String(16), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("gpu_ms", sa.Double(), nullable=False),
        sa.Column("queue_ms", sa.Double(), nullable=False),
        sa.Column("ttft_ms", sa.Double(), nullable=True),
        sa.Column("latency_ms", sa.Double(), nullable=False),
        sa.Column("replica", sa.String(128), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("cost", sa.Numeric(18, 6), nullable=True),
        sa.Column("currency", sa.String(3), nullable=True),
        sa.PrimaryKeyConstraint("request_id", name="pk_usage_events"),
        sa.CheckConstraint("status IN ('completed', 'aborted', 'failed')", name="ck_usage_events_status"),
        sa.Index("ix_usage_events_tenant_started", "tenant_id", "started_at"),
    )
