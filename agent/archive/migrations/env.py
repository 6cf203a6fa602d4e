"""Alembic environment of the archive, for the agent and for the command line.

The agent runs the migrations on the connection it has already opened and checked, passed in
``config.attributes["connection"]``, and keeps its own logging. From the command line
(``alembic upgrade head`` or ``alembic revision --autogenerate`` in the repository root, configured
by ``[tool.alembic]`` in pyproject.toml) the database comes from SUSTAIN_ARCHIVE__DATABASE_URL, the
variable the agent itself reads, so that a developer migrates the database the agent uses.
"""

from __future__ import annotations

import logging
import os
from typing import Literal

from alembic import context
from alembic.autogenerate.api import AutogenContext
from sqlalchemy import Connection, text
from sqlalchemy.types import TypeDecorator

from agent.archive.database import ArchiveError, open_engine
from agent.archive.models import Base
from agent.archive.partitions import include_name

URL_VARIABLE = "SUSTAIN_ARCHIVE__DATABASE_URL"

# Every agent of a fleet migrates the shared PostgreSQL database when it starts; this lock (the
# bytes of "sustain!") makes them take turns, so the first applies the migrations and the others
# find nothing left to do. Being transaction-scoped, it is released with the commit.
MIGRATION_LOCK_KEY = 0x7375737461696E21


def _render_item(type_: str, obj: object, autogen_context: AutogenContext) -> str | Literal[False]:
    # Migrations must not import the models (they change; a migration must not), so a decorated
    # type such as UTCDateTime is written as the plain SQLAlchemy type it stores.
    if type_ == "type" and isinstance(obj, TypeDecorator):
        return f"sa.{obj.impl_instance!r}"
    return False


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        compare_type=True,
        # Batch operations work on both backends, and SQLite alters a table only by copying it.
        render_as_batch=True,
        render_item=_render_item,
        include_name=include_name,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            lock = text("SELECT pg_advisory_xact_lock(:key)")
            connection.execute(lock, {"key": MIGRATION_LOCK_KEY})
            # A migration reads and writes whole tables (minutes at 10 million runs): not bound
            # by the statement timeout that guards the agent's own statements.
            connection.exec_driver_sql("SET LOCAL statement_timeout = 0")
        context.run_migrations()


def _url_from_environment() -> str:
    url = os.environ.get(URL_VARIABLE)
    if not url:
        raise SystemExit(
            f"{URL_VARIABLE} is not set; set it to the archive's database URL, "
            "e.g. sqlite:////var/lib/sustain/sustain.db"
        )
    return url


def main() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    logging.basicConfig(level=logging.INFO, format="%(levelname)-5.5s [%(name)s] %(message)s")
    if context.is_offline_mode():
        context.configure(
            url=_url_from_environment(),
            target_metadata=Base.metadata,
            literal_binds=True,
            render_as_batch=True,
        )
        with context.begin_transaction():
            context.run_migrations()
        return
    try:
        engine = open_engine(_url_from_environment())
    except ArchiveError as exc:
        raise SystemExit(str(exc)) from None
    try:
        with engine.begin() as connection:
            _run(connection)
    finally:
        engine.dispose()


main()
