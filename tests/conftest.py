"""Fixtures shared by the test modules.

The archive is tested against the real thing on both supported backends: a SQLite file and the
PostgreSQL server that development and CI machines run at 127.0.0.1:5432 (trust authentication,
user ``postgres``, maintenance database ``test``). A missing server fails the PostgreSQL tests
instead of skipping them, so that a green run always means both backends were exercised.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import OperationalError

from agent.archive.database import open_engine, upgrade

POSTGRES_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432"
POSTGRES_MAINTENANCE_URL = f"{POSTGRES_SERVER}/test"


@pytest.fixture(scope="session")
def postgres_admin() -> Iterator[Engine]:
    """An AUTOCOMMIT engine on the maintenance database, for CREATE and DROP DATABASE."""
    engine = create_engine(POSTGRES_MAINTENANCE_URL, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect():
            unreachable = None
    except OperationalError as exc:
        engine.dispose()
        unreachable = str(exc.orig).splitlines()[0]
    if unreachable is not None:  # failed outside the except block: no chained traceback
        pytest.fail(
            f"PostgreSQL is needed at {POSTGRES_MAINTENANCE_URL} and is unreachable: {unreachable}",
            pytrace=False,
        )
    yield engine
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of a new, empty database: a file in tmp_path, or a database made for this test."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'archive.db'}"
        return
    admin: Engine = request.getfixturevalue("postgres_admin")
    name = f"sustain_test_{uuid.uuid4().hex[:16]}"
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield f"{POSTGRES_SERVER}/{name}"
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def archive_engine(database_url: str) -> Iterator[Engine]:
    """An engine on ``database_url`` migrated to the newest revision."""
    engine = open_engine(database_url)
    try:
        upgrade(engine)
        yield engine
    finally:
        engine.dispose()
