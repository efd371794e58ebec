"""What every billing model shares: the declarative Base (one MetaData, one registry), its constraint naming
convention, id and clock helpers, and the UTCDateTime column type.

The tables themselves live one noun per module beside this one; billing.models imports them all, so that
Base.metadata is complete (for Alembic) once the package is imported.
"""

import secrets
from datetime import UTC, datetime

from sqlalchemy import DateTime, Dialect, MetaData
from sqlalchemy.orm import DeclarativeBase
from sqlalchemy.types import TypeDecorator

# Deterministic constraint names: Alembic can then drop or alter them by name on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz234567"  # lowercase base32


def new_id(kind: str) -> str:
    """`<kind>_` and 20 base32 characters (100 random bits)."""
    return f"{kind}_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(20))


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Aware datetimes in, aware UTC datetimes out, stored as UTC.

    Naive values are refused rather than guessed at. SQLite keeps no offset, so UTC is attached on read.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value.isoformat()} given; use an aware (UTC) datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
