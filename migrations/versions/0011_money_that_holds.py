"""Money that holds (issue 35): when a tenant became prepaid, so that its credit pays only for usage from
then on (the hours before were invoiced by Stripe); and beside each credit entry's `actor` (what the caller
said), the request that wrote it and its surface (admin API or CLI); and each hourly rollup's currency, in
its key, so that a postpaid tenant whose tier changes currency gets a rollup per currency in that hour
instead of one summing both.

Existing data: a prepaid tenant's `prepaid_since` is its first credit entry, the moment the Stripe export
already counts its prepaid usage from; existing credit entries keep NULL request ids and surfaces (unknown);
an existing rollup's currency is its usage rows' (the least, for an hour that already mixed two: the next
recompute of that hour splits it), else its tenant's tier's. Rollups keep their ids. A downgrade fails
while an hour holds two currencies (0010 cannot hold them).

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


SURFACE_CHECK = "surface IN ('admin_api', 'cli')"


def upgrade() -> None:
    op.add_column("tenants", sa.Column("prepaid_since", sa.DateTime(timezone=True), nullable=True))
    _backfill_prepaid_since()
    with op.batch_alter_table("credit_entries", copy_from=_credit_entries_0010()) as batch:
        batch.add_column(sa.Column("request_id", sa.String(64), nullable=True))
        batch.add_column(sa.Column("surface", sa.String(16), nullable=True))
        batch.create_check_constraint(op.f("ck_credit_entries_surface"), SURFACE_CHECK)
    op.add_column("usage_rollups", sa.Column("currency", sa.String(3), nullable=True))
    op.execute(_ROLLUP_CURRENCY[op.get_context().dialect.name])
    with op.batch_alter_table("usage_rollups", copy_from=_usage_rollups(upgraded=False)) as batch:
        batch.alter_column("currency", existing_type=sa.String(3), nullable=False)
        batch.drop_constraint("uq_usage_rollups_key", type_="unique")
        batch.create_unique_constraint("uq_usage_rollups_key", [*ROLLUP_KEY, "currency"])


# The rollup's rows' currency (the hour matched as each backend stores times), else its tier's.
_ROLLUP_CURRENCY_SQL = """
UPDATE usage_rollups SET currency = COALESCE(
    (SELECT MIN(e.currency) FROM usage_events e
     WHERE e.tenant_id = usage_rollups.tenant_id AND COALESCE(e.adapter_id, 'base') = usage_rollups.adapter_key
       AND e.base_model = usage_rollups.base_model AND {same_hour}),
    (SELECT t.currency FROM tenants n JOIN tiers t ON t.name = n.tier WHERE n.id = usage_rollups.tenant_id),
    'xxx')
"""
_ROLLUP_CURRENCY = {
    "postgresql": _ROLLUP_CURRENCY_SQL.format(
        same_hour="e.started_at >= usage_rollups.hour AND e.started_at < usage_rollups.hour + interval '1 hour'"
    ),
    "sqlite": _ROLLUP_CURRENCY_SQL.format(
        same_hour="strftime('%Y-%m-%d %H', e.started_at) = strftime('%Y-%m-%d %H', usage_rollups.hour)"
    ),
}
ROLLUP_KEY = ("tenant_id", "adapter_key", "base_model", "hour")


def _backfill_prepaid_since() -> None:
    """One UPDATE, so that offline (--sql) generation writes it too."""
    tenants = sa.table("tenants", sa.column("id"), sa.column("prepaid"), sa.column("prepaid_since"))
    entries = sa.table("credit_entries", sa.column("tenant_id"), sa.column("created_at"))
    first = sa.select(sa.func.min(entries.c.created_at)).where(entries.c.tenant_id == tenants.c.id)
    op.execute(
        tenants.update().where(tenants.c.prepaid == sa.true()).values(prepaid_since=first.scalar_subquery())
    )


def downgrade() -> None:
    with op.batch_alter_table("usage_rollups", copy_from=_usage_rollups(upgraded=True)) as batch:
        batch.drop_constraint("uq_usage_rollups_key", type_="unique")
        batch.create_unique_constraint("uq_usage_rollups_key", list(ROLLUP_KEY))
        batch.drop_column("currency")
    with op.batch_alter_table("credit_entries", copy_from=_credit_entries_0011()) as batch:
        batch.drop_constraint(op.f("ck_credit_entries_surface"), type_="check")
        batch.drop_column("surface")
        batch.drop_column("request_id")
    with op.batch_alter_table("tenants", copy_from=_tenants_0011()) as batch:
        batch.drop_column("prepaid_since")


def _credit_entries_0010() -> sa.Table:
    """credit_entries as revision 0010 left it (SQLite rebuilds the table to add a CHECK)."""
    return sa.Table("credit_entries", sa.MetaData(), *_credit_entry_columns(), *_credit_entry_keys())


def _credit_entries_0011() -> sa.Table:
    """credit_entries as this revision leaves it (SQLite rebuilds the table to drop columns)."""
    return sa.Table(
        "credit_entries",
        sa.MetaData(),
        *_credit_entry_columns(),
        sa.Column("request_id", sa.String(64), nullable=True),
        sa.Column("surface", sa.String(16), nullable=True),
        *_credit_entry_keys(),
        sa.CheckConstraint(SURFACE_CHECK, name="ck_credit_entries_surface"),
    )


def _credit_entry_columns() -> list[sa.Column[object]]:
    return [
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("amount", sa.Numeric(18, 6), nullable=False),
        sa.Column("currency", sa.String(3), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    ]


def _credit_entry_keys() -> list[sa.Constraint | sa.Index]:
    return [
        sa.PrimaryKeyConstraint("id", name="pk_credit_entries"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name="fk_credit_entries_tenant_id_tenants"),
        sa.CheckConstraint("kind IN ('topup', 'adjustment')", name="ck_credit_entries_kind"),
        sa.Index("ix_credit_entries_tenant_id", "tenant_id"),
    ]


def _tenants_0011() -> sa.Table:
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
        sa.Column("prepaid_since", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_tenants"),
        sa.UniqueConstraint("name", name="uq_tenants_name"),
        sa.ForeignKeyConstraint(["tier"], ["tiers.name"], name="fk_tenants_tier_tiers", onupdate="CASCADE"),
        sa.CheckConstraint("status IN ('active', 'disabled')", name="ck_tenants_status"),
    )


def _usage_rollups(*, upgraded: bool) -> sa.Table:
    """usage_rollups as this revision leaves it (upgraded: the currency required and in the key), or as
    its upgrade finds it after adding the column (nullable, not in the key): SQLite rebuilds the table to
    change a column or a constraint."""
    key = (*ROLLUP_KEY, "currency") if upgraded else ROLLUP_KEY
    return sa.Table(
        "usage_rollups",
        sa.MetaData(),
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
        sa.Column("cost_micros", sa.BigInteger(), nullable=True),
        sa.Column("currency", sa.String(3), nullable=not upgraded),
        sa.PrimaryKeyConstraint("id", name="pk_usage_rollups"),
        sa.UniqueConstraint(*key, name="uq_usage_rollups_key"),
        sa.Index("ix_usage_rollups_tenant_id", "tenant_id"),
    )
