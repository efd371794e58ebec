"""Batch lines' claim order and lost runs (issue 37): `prefix`, the opening of each line's prompt, which
lines are claimed in within a model (lines sharing a prompt's start run together: the prefix cache prefills
it once); `lost`, how many of a line's claims ended with its runner gone (its lease lapsed), bounded apart
from the platform's failures, which are retried after waits. Existing lines get an empty prefix (claimed in
line order, as before) and no losses.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | Sequence[str] | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("batch_lines", sa.Column("prefix", sa.String(256), nullable=False, server_default=""))
    op.add_column("batch_lines", sa.Column("lost", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    # SQLite 3.35 on drops a plain column in place
    op.drop_column("batch_lines", "lost")
    op.drop_column("batch_lines", "prefix")
