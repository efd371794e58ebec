"""SchemaGate on both backends: a database whose schema goes away after the gate saw it at head is read
again once a statement fails as a missing table does, and refused by name (issue 14, item 9)."""

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, event, select
from sqlalchemy.exc import OperationalError, ProgrammingError

from billing.db import make_engine, make_session_factory
from billing.migrate import downgrade, head, upgrade
from billing.models import Tenant
from billing.schema_gate import DatabaseNotMigrated, SchemaGate

MISSING_TABLE = (OperationalError, ProgrammingError)  # SQLite's word for it, PostgreSQL's


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    upgrade(database_url)
    built = make_engine(database_url)
    yield built
    built.dispose()


def test_a_schema_dropped_after_the_gate_saw_head_is_refused_by_name(
    database_url: str, engine: Engine
) -> None:
    sessions = make_session_factory(engine, check=SchemaGate(engine, recheck_s=0.0).require)
    with sessions() as session:
        session.scalars(select(Tenant)).all()  # at head: served
    downgrade(database_url, "base")
    with sessions() as session, pytest.raises(MISSING_TABLE):
        session.scalars(select(Tenant)).all()  # no table: the database says so, the gate notes it
    with pytest.raises(DatabaseNotMigrated) as refused:
        sessions()  # before: a session, and the same missing-table error on every call for ever
    assert refused.value.found is None and refused.value.expected == head()
    upgrade(database_url)
    with sessions() as session:  # and upgrading serves again
        session.scalars(select(Tenant)).all()


def test_an_error_within_the_recheck_interval_costs_no_extra_read(database_url: str, engine: Engine) -> None:
    """The gate re-reads the revision at most once per recheck_s, however many statements fail."""
    gate = SchemaGate(engine, recheck_s=3600.0)
    sessions = make_session_factory(engine, check=gate.require)
    with sessions() as session:
        session.scalars(select(Tenant)).all()
    downgrade(database_url, "base")
    reads: list[str] = []

    def seen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "alembic_version" in statement:
            reads.append(statement)

    event.listen(engine, "before_cursor_execute", seen)
    for _ in range(3):
        with sessions() as session, pytest.raises(MISSING_TABLE):
            session.scalars(select(Tenant)).all()
    assert reads == []
