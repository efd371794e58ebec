"""Rate limits: tiers sell rpm, tpm, concurrency and a max_tokens cap, with reject-or-queue on limit;
tenants may override each. Seeds the `pro` and `enterprise` tiers and gives `free` its limits.

Revision ID: 0003
Revises: 0002
Create Date: 2025-11-22
"""

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LIMITS = ("rpm", "tpm", "max_concurrent", "max_tokens_cap")
SEED = {  # name: (description, rpm, tpm, max_concurrent, max_tokens_cap, on_limit, max_queue_ms)
    "free": ("Default tier", 60, 100_000, 8, 4096, "reject", 0),
    "pro": ("Higher rates; bursts wait up to 5 s instead of failing", 600, 1_000_000, 64, 8192, "queue", 5000),
    "enterprise": ("No platform rate limits", None, None, None, None, "reject", 0),
}

# The tiers table as revision 0002 left it: SQLite's batch mode rebuilds tables (to add the CHECK), and
# giving it the definition instead of reflecting one keeps offline (--sql) generation possible.
def _tier_columns_0002() -> list[sa.Column[object]]:
    return [
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    ]


_TIERS_0002 = sa.Table(
    "tiers", sa.MetaData(), *_tier_columns_0002(), sa.PrimaryKeyConstraint("name", name="pk_tiers")
)


def _tiers_0003() -> sa.Table:
    return sa.Table(
        "tiers",
        sa.MetaData(),
        *_tier_columns_0002(),
        *_limit_columns(),
        sa.Column("on_limit", sa.String(8), nullable=False),
        sa.Column("max_queue_ms", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_tiers"),
        sa.CheckConstraint("on_limit IN ('reject', 'queue')", name="ck_tiers_on_limit"),
    )


def _tenants_0003() -> sa.Table:
    """The tenants table as this revision leaves it (for the SQLite rebuild on downgrade)."""
    return sa.Table(
        "tenants",
        sa.MetaData(),
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("tier", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("disabled_at", sa.DateTime(timezone=True), nullable=True),
        *_limit_columns(),
        sa.PrimaryKeyConstraint("id", name="pk_tenants"),
        sa.UniqueConstraint("name", name="uq_tenants_name"),
        sa.ForeignKeyConstraint(["tier"], ["tiers.name"], name="fk_tenants_tier_tiers", onupdate="CASCADE"),
        sa.CheckConstraint("status IN ('active', 'disabled')", name="ck_tenants_status"),
    )


def _limit_columns() -> list[sa.Column[int]]:
    return [
        sa.Column("rpm", sa.Integer(), nullable=True),
        sa.Column("tpm", sa.BigInteger(), nullable=True),
        sa.Column("max_concurrent", sa.Integer(), nullable=True),
        sa.Column("max_tokens_cap", sa.Integer(), nullable=True),
    ]


def upgrade() -> None:
    with op.batch_alter_table("tiers", copy_from=_TIERS_0002) as batch:
        for column in _limit_columns():
            batch.add_column(column)
        # Server defaults fill the rows that exist; new rows get their values from the application.
        batch.add_column(sa.Column("on_limit", sa.String(8), nullable=False, server_default="reject"))
        batch.add_column(sa.Column("max_queue_ms", sa.Integer(), nullable=False, server_default="0"))
        batch.create_check_constraint(op.f("ck_tiers_on_limit"), "on_limit IN ('reject', 'queue')")
    for column in _limit_columns():
        op.add_column("tenants", column)

    tiers = sa.table(
        "tiers",
        sa.column("name", sa.String),
        sa.column("description", sa.Text),
        sa.column("created_at", sa.DateTime(timezone=True)),
        *(sa.column(name, sa.Integer) for name in LIMITS),
        sa.column("on_limit", sa.String),
        sa.column("max_queue_ms", sa.Integer),
    )
    now = datetime.now(UTC)
    for name, (description, *values) in SEED.items():
        row = dict(zip((*LIMITS, "on_limit", "max_queue_ms"), values, strict=True))
        op.execute(tiers.update().where(tiers.c.name == name).values(**row))
        # Insert unless an operator already made a tier of that name (plain SQL: works offline too).
        missing = ~sa.exists(sa.select(tiers.c.name).where(tiers.c.name == name))
        literals = [sa.literal(v) for v in (name, description, now, *values)]
        op.execute(tiers.insert().from_select(["name", "description", "created_at", *LIMITS, "on_limit",
                                                "max_queue_ms"], sa.select(*literals).where(missing)))  # fmt: skip


def downgrade() -> None:
    with op.batch_alter_table("tenants", copy_from=_tenants_0003()) as batch:
        for name in reversed(LIMITS):
            batch.drop_column(name)
    with op.batch_alter_table("tiers", copy_from=_tiers_0003()) as batch:
        batch.drop_constraint(op.f("ck_tiers_on_limit"), type_="check")
        for name in ("max_queue_ms", "on_limit", *reversed(LIMITS)):
            batch.drop_column(name)
    # Tenants may reference the seeded tiers; they stay (the data, unlike the schema, is not ours to drop).
