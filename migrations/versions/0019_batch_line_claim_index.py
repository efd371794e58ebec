"""Batch lines claimed in index order (issue 37): `ix_batch_lines_claim` on (batch_id, state, model, prefix,
line) replaces `ix_batch_lines_batch_state`, its prefix, so a claim reads a batch's next queued lines in
claim order (model, then the opening of the prompt) from the index instead of sorting every queued line
of the batch (8 ms a claim for 50,000 lines on SQLite, under the tenant's lock; 0.01 ms from the index).
Counts by batch and state use the same prefix as before.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-30
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0019"
down_revision: str | Sequence[str] | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_batch_lines_claim", "batch_lines", ["batch_id", "state", "model", "prefix", "line"]
    )
    op.drop_index("ix_batch_lines_batch_state", table_name="batch_lines")


def downgrade() -> None:
    op.create_index("ix_batch_lines_batch_state", "batch_lines", ["batch_id", "state"])
    op.drop_index("ix_batch_lines_claim", table_name="batch_lines")
