"""Routing quality in engine reports: requests naming an adapter, how many found it already resident, and
each adapter version's reads from the store on that replica.

Revision ID: 0005
Revises: 0004
Create Date: 2025-11-22
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    for name in ("adapter_requests", "adapter_hits"):
        op.add_column("engine_reports", sa.Column(name, sa.BigInteger(), nullable=False, server_default="0"))
    op.add_column("engine_reports", sa.Column("adapter_loads", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("engine_reports", copy_from=_engine_reports_0005()) as batch:
        batch.drop_column("adapter_loads")
        batch.drop_column("adapter_hits")
        batch.drop_column("adapter_requests")


def _engine_reports_0005() -> sa.Table:
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
        sa.PrimaryKeyConstraint("replica", name="pk_engine_reports"),
    )
