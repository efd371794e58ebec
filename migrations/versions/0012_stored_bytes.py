"""Stored responses that cannot fill the disk (issue 35, item 1): an index on stored_responses.expires_at,
so the timer that deletes every tenant's expired rows (ResponseStore.sweep) finds them without a scan (the
existing index leads with tenant_id, for reads by tenant); and a tier's stored-bytes quota,
`max_stored_response_bytes` (NULL, as every existing tier gets: no bound).

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


PRICES = ("price_input_per_mtok", "price_cached_input_per_mtok", "price_output_per_mtok", "price_gpu_per_second")


def upgrade() -> None:
    op.create_index("ix_stored_responses_expires", "stored_responses", ["expires_at"])
    op.add_column("tiers", sa.Column("max_stored_response_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tiers", copy_from=_tiers_0012()) as batch:
        batch.drop_column("max_stored_response_bytes")
    op.drop_index("ix_stored_responses_expires", table_name="stored_responses")


def _tiers_0012() -> sa.Table:
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
        sa.Column("max_stored_response_bytes", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("name", name="pk_tiers"),
        sa.CheckConstraint("on_limit IN ('reject', 'queue')", name="ck_tiers_on_limit"),
    )
