"""A tier's weight (issue 34): its tenants' share of an engine replica against other tenants while they
wait (the engine's fair admission divides the service it serves a tenant by it). Every tier starts at 1.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PRICES = ("price_input_per_mtok", "price_cached_input_per_mtok", "price_output_per_mtok", "price_gpu_per_second")


def upgrade() -> None:
    op.add_column("tiers", sa.Column("weight", sa.Double(), nullable=False, server_default="1"))


def downgrade() -> None:
    with op.batch_alter_table("tiers", copy_from=_tiers_0009()) as batch:
        batch.drop_column("weight")


def _tiers_0009() -> sa.Table:
    """tiers as this revision leaves it (SQLite rebuilds the table to drop a column)."""
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
        sa.Column("weight", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_tiers"),
        sa.CheckConstraint("on_limit IN ('reject', 'queue')", name="ck_tiers_on_limit"),
    )
