"""Each hourly rollup's cost (issue 29): the sum of its usage rows' settled costs, in micro-units, which the
Stripe export sends to a monetary meter.

Existing rollups keep NULL (their cost was never computed) until the metering service recomputes their hour;
a NULL cost is never exported: those hours' quantities were.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-27
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("usage_rollups", sa.Column("cost_micros", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_rollups", copy_from=_usage_rollups_0007()) as batch:
        batch.drop_column("cost_micros")


def _usage_rollups_0007() -> sa.Table:
    """usage_rollups as this revision leaves it (SQLite rebuilds the table to drop a column)."""
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
        sa.PrimaryKeyConstraint("id", name="pk_usage_rollups"),
        sa.UniqueConstraint("tenant_id", "adapter_key", "base_model", "hour", name="uq_usage_rollups_key"),
        sa.Index("ix_usage_rollups_tenant_id", "tenant_id"),
    )
