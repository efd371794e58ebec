"""Metering and billing: usage events, hourly rollups, Stripe exports, engine reports; tier prices and
tenants' Stripe customer ids.

Revision ID: 0004
Revises: 0003
Create Date: 2025-11-22
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PRICES = ("price_input_per_mtok", "price_cached_input_per_mtok", "price_output_per_mtok", "price_gpu_per_second")


def upgrade() -> None:
    for name in PRICES:
        op.add_column("tiers", sa.Column(name, sa.Numeric(18, 6), nullable=False, server_default="0"))
    op.add_column("tiers", sa.Column("currency", sa.String(3), nullable=False, server_default="usd"))
    op.add_column("tenants", sa.Column("stripe_customer_id", sa.String(64), nullable=True))

    op.create_table(
        "usage_events",
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
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_usage_events")),
        sa.CheckConstraint("status IN ('completed', 'aborted', 'failed')", name=op.f("ck_usage_events_status")),
    )
    op.create_index("ix_usage_events_tenant_started", "usage_events", ["tenant_id", "started_at"])
    op.create_table(
        "usage_rollups",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("adapter_key", sa.String(64), nullable=False),
        sa.Column("base_model", sa.String(128), nullable=False),
        sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("gpu_ms", sa.Double(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_rollups")),
        sa.UniqueConstraint("tenant_id", "adapter_key", "base_model", "hour", name=op.f("uq_usage_rollups_key")),
    )
    op.create_index(op.f("ix_usage_rollups_tenant_id"), "usage_rollups", ["tenant_id"])
    op.create_table(
        "stripe_exports",
        sa.Column("identifier", sa.String(128), nullable=False),
        sa.Column("rollup_id", sa.String(32), nullable=False),
        sa.Column("meter", sa.String(64), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("value", sa.BigInteger(), nullable=False),
        sa.Column("customer", sa.String(64), nullable=False),
        sa.Column("timestamp", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("identifier", name=op.f("pk_stripe_exports")),
        sa.ForeignKeyConstraint(
            ["rollup_id"], ["usage_rollups.id"], name=op.f("fk_stripe_exports_rollup_id_usage_rollups")
        ),
        sa.CheckConstraint(
            "status IN ('pending', 'sent', 'failed', 'skipped')", name=op.f("ck_stripe_exports_status")
        ),
    )
    op.create_index("ix_stripe_exports_rollup_meter", "stripe_exports", ["rollup_id", "meter"])
    op.create_table(
        "engine_reports",
        sa.Column("replica", sa.String(128), nullable=False),
        sa.Column("base_model", sa.String(128), nullable=False),
        sa.Column("busy_ms", sa.Double(), nullable=False),
        sa.Column("wall_ms", sa.Double(), nullable=False),
        sa.Column("steps", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("replica", name=op.f("pk_engine_reports")),
    )


def downgrade() -> None:
    op.drop_table("engine_reports")
    op.drop_index("ix_stripe_exports_rollup_meter", table_name="stripe_exports")
    op.drop_table("stripe_exports")
    op.drop_index(op.f("ix_usage_rollups_tenant_id"), table_name="usage_rollups")
    op.drop_table("usage_rollups")
    op.drop_index("ix_usage_events_tenant_started", table_name="usage_events")
    op.drop_table("usage_events")
    with op.batch_alter_table("tenants", copy_from=_tenants_0004()) as batch:
        batch.drop_column("stripe_customer_id")
    with op.batch_alter_table("tiers", copy_from=_tiers_0004()) as batch:
        batch.drop_column("currency")
        for name in reversed(PRICES):
            batch.drop_column(name)


def _tenants_0004() -> sa.Table:
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
        sa.PrimaryKeyConstraint("id", name="pk_tenants"),
        sa.UniqueConstraint("name", name="uq_tenants_name"),
        sa.ForeignKeyConstraint(["tier"], ["tiers.name"], name="fk_tenants_tier_tiers", onupdate="CASCADE"),
        sa.CheckConstraint("status IN ('active', 'disabled')", name="ck_tenants_status"),
    )


def _tiers_0004() -> sa.Table:
    return sa.Table(
        "tiers",
        sa.MetaData(),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("rpm", sa.Integer(), nullable=True),
        sa.Column("tpm", sa.BigInteger(), nullable=True),
        sa.Column("max_concurrent", sa.Integer(), nullable=True),
        sa.Column("max_tokens_cap", sa.Integer(), nullable=True),
        sa.Column("on_limit", sa.String(8), nullable=False),
        sa.Column("max_queue_ms", sa.Integer(), nullable=False),
        *(sa.Column(name, sa.Numeric(18, 6), nullable=False) for name in PRICES),
        sa.Column("currency", sa.String(3), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_tiers"),
        sa.CheckConstraint("on_limit IN ('reject', 'queue')", name="ck_tiers_on_limit"),
    )
