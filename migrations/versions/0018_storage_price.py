"""A tier's storage price (issue 35): `tiers.price_storage_per_gb_day`, per GB (10^9 bytes) of its tenants'
stored responses and files a day, charged hourly as a usage row (app/storage_billing.py). Existing tiers
get 0: storage stays free until an admin prices it.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | Sequence[str] | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "tiers",
        sa.Column("price_storage_per_gb_day", sa.Numeric(18, 6), nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_column("tiers", "price_storage_per_gb_day")
