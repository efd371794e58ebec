"""Each engine replica's tenant-isolation figures in its report (issue 34): the fair order's service per
tenant, waiting per tenant and its oldest wait, preemptions by reason, queues per adapter and the ranks
resident in device slots, for GET /admin/engines. NULL until the replica next reports.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("engine_reports", sa.Column("isolation", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("engine_reports", copy_from=_engine_reports_0010()) as batch:
        batch.drop_column("isolation")


def _engine_reports_0010() -> sa.Table:
    """engine_reports as this revision leaves it (SQLite rebuilds the table to drop a column)."""
    return sa.Table(
        "engine_reports",
        sa.MetaData(),
        sa.Column("replica", sa.String(128), nullable=False),
        sa.Column("base_model", sa.String(128), nullable=False),
        sa.Column("busy_ms", sa.Double(), nullable=False),
        sa.Column("wall_ms", sa.Double(), nullable=False),
        sa.Column("steps", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("adapter_requests", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("adapter_hits", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("adapter_loads", sa.JSON(), nullable=True),
        sa.Column("isolation", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("replica", name="pk_engine_reports"),
    )
