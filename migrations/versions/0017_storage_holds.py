"""Storage holds (issue 35): `storage_holds`, the bytes each Responses request with store true may store,
counted against its tenant's storage quota from admission until its response is stored, so that concurrent
requests (and file uploads) see each other. A new table only: downgrade drops it.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | Sequence[str] | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "storage_holds",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_storage_holds"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name="fk_storage_holds_tenant_id_tenants"),
    )
    op.create_index("ix_storage_holds_tenant_expires", "storage_holds", ["tenant_id", "expires_at"])
    op.create_index("ix_storage_holds_expires", "storage_holds", ["expires_at"])


def downgrade() -> None:
    op.drop_table("storage_holds")
