"""Batch prices and usage (issue 37, item 4): each tier's `batch_price_factor`, what a Batch API line's cost
is multiplied by (0.5 for existing tiers: half the interactive price, as OpenAI's Batch API), and each
usage row's `batch_id` (NULL: an interactive request).

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | Sequence[str] | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "tiers", sa.Column("batch_price_factor", sa.Numeric(6, 4), nullable=False, server_default="0.5")
    )
    op.add_column("usage_events", sa.Column("batch_id", sa.String(64), nullable=True))


def downgrade() -> None:
    # SQLite 3.35 on drops a plain column in place
    op.drop_column("usage_events", "batch_id")
    op.drop_column("tiers", "batch_price_factor")
