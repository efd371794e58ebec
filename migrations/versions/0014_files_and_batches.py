"""The Files and Batch APIs (issue 37, items 1 and 2): `files` (a tenant's files' metadata; their bytes are in
the adapter store's backend), `batches` (one row per batch, its status, counts and timestamps) and
`batch_lines` (each validated request line of a batch, with the state and lease columns a runner claims it
by). New tables only: downgrade drops them (the files' bytes stay in the store, unreferenced).

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | Sequence[str] | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

WHEN = sa.DateTime(timezone=True)
STATUSES = (
    "status IN ('validating', 'in_progress', 'finalizing', 'completed', 'failed', 'expired', "
    "'cancelling', 'cancelled')"
)


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("purpose", sa.String(16), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("lines", sa.Integer(), nullable=False),
        sa.Column("blob", sa.String(128), nullable=False),
        sa.Column("created_at", WHEN, nullable=False),
        sa.Column("expires_at", WHEN, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_files"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name="fk_files_tenant_id_tenants"),
        sa.CheckConstraint("purpose IN ('batch', 'batch_output')", name="ck_files_purpose"),
    )
    op.create_index("ix_files_tenant_created", "files", ["tenant_id", "created_at"])
    op.create_index("ix_files_expires", "files", ["expires_at"])
    op.create_table(
        "batches",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=False),
        sa.Column("endpoint", sa.String(32), nullable=False),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(8), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("output_file_id", sa.String(64), nullable=True),
        sa.Column("error_file_id", sa.String(64), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("completed", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("created_at", WHEN, nullable=False),
        sa.Column("expires_at", WHEN, nullable=False),
        *(
            sa.Column(f"{status}_at", WHEN, nullable=True)
            for status in (
                "in_progress",
                "finalizing",
                "completed",
                "failed",
                "expired",
                "cancelling",
                "cancelled",
            )
        ),
        sa.PrimaryKeyConstraint("id", name="pk_batches"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name="fk_batches_tenant_id_tenants"),
        sa.CheckConstraint(STATUSES, name="ck_batches_status"),
    )
    op.create_index("ix_batches_tenant_created", "batches", ["tenant_id", "created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(64), nullable=False),
        sa.Column("line", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("custom_id", sa.String(512), nullable=False),
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(128), nullable=True),
        sa.Column("lease_expires_at", WHEN, nullable=True),
        sa.Column("response", sa.JSON(), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("finished_at", WHEN, nullable=True),
        sa.PrimaryKeyConstraint("batch_id", "line", name="pk_batch_lines"),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], name="fk_batch_lines_batch_id_batches"),
        sa.CheckConstraint("state IN ('queued', 'running', 'done', 'failed')", name="ck_batch_lines_state"),
        sa.UniqueConstraint("batch_id", "custom_id", name="uq_batch_lines_custom_id"),
    )
    op.create_index("ix_batch_lines_batch_state", "batch_lines", ["batch_id", "state"])


def downgrade() -> None:
    op.drop_table("batch_lines")
    op.drop_table("batches")
    op.drop_table("files")
