"""Adapter registry: adapters (name per owner, soft-deleted) and their immutable versions.

Revision ID: 0002
Revises: 0001
Create Date: 2025-11-22
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("owner", sa.String(32), nullable=False),
        sa.Column("base_model", sa.String(128), nullable=False),
        sa.Column("pinned", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapters")),
    )
    # Unique among live adapters only: a deleted name may be uploaded again as a new adapter.
    op.create_index(
        "ix_adapters_owner_name_live",
        "adapters",
        ["owner", "name"],
        unique=True,
        sqlite_where=sa.text("deleted_at IS NULL"),
        postgresql_where=sa.text("deleted_at IS NULL"),
    )
    op.create_index("ix_adapters_base_model", "adapters", ["base_model"])
    op.create_table(
        "adapter_versions",
        sa.Column("adapter_id", sa.String(32), nullable=False),
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("target_modules", sa.JSON(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("adapter_id", "version", name=op.f("pk_adapter_versions")),
        sa.ForeignKeyConstraint(
            ["adapter_id"], ["adapters.id"], name=op.f("fk_adapter_versions_adapter_id_adapters")
        ),
    )


def downgrade() -> None:
    op.drop_table("adapter_versions")
    op.drop_index("ix_adapters_base_model", table_name="adapters")
    op.drop_index("ix_adapters_owner_name_live", table_name="adapters")
    op.drop_table("adapters")
