"""Stored chains by reference (issue 35, item 1): a continuation's row keeps its own items and a reference to
its predecessor (`context_from`, the leading items of the predecessor's chain it dropped in
`context_skip`, and its `depth` in hops to a row holding its context itself) instead of a flattened copy
of the whole chain; a response its tenant deleted while a later stored response still continues it is
kept, `deleted`, as a link of that chain (it reads as missing). Existing rows hold their context
themselves: depth 0, no reference.

Downgrade deletes the rows stored by reference (the code before this revision cannot read their chains)
and the deleted links.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("stored_responses", sa.Column("context_from", sa.String(64), nullable=True))
    op.add_column(
        "stored_responses", sa.Column("context_skip", sa.Integer(), nullable=False, server_default="0")
    )
    op.add_column("stored_responses", sa.Column("depth", sa.Integer(), nullable=False, server_default="0"))
    op.add_column(
        "stored_responses", sa.Column("deleted", sa.Boolean(), nullable=False, server_default=sa.false())
    )
    op.create_index("ix_stored_responses_context_from", "stored_responses", ["context_from"])


def downgrade() -> None:
    rows = sa.table(
        "stored_responses", sa.column("context_from", sa.String(64)), sa.column("deleted", sa.Boolean())
    )
    op.execute(sa.delete(rows).where(sa.or_(rows.c.context_from.is_not(None), rows.c.deleted.is_(True))))
    op.drop_index("ix_stored_responses_context_from", table_name="stored_responses")
    with op.batch_alter_table("stored_responses", copy_from=_stored_responses_0013()) as batch:
        batch.drop_column("deleted")
        batch.drop_column("depth")
        batch.drop_column("context_skip")
        batch.drop_column("context_from")


def _stored_responses_0013() -> sa.Table:
    """stored_responses as this revision leaves it (SQLite rebuilds the table to drop a column)."""
    return sa.Table(
        "stored_responses",
        sa.MetaData(),
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("previous_response_id", sa.String(64), nullable=True),
        sa.Column("context", sa.JSON(), nullable=False),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("context_from", sa.String(64), nullable=True),
        sa.Column("context_skip", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("depth", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("deleted", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.PrimaryKeyConstraint("id", name="pk_stored_responses"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name="fk_stored_responses_tenant_id_tenants"),
        sa.Index("ix_stored_responses_tenant_expires", "tenant_id", "expires_at"),
        sa.Index("ix_stored_responses_expires", "expires_at"),
    )
