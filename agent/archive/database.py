"""Opening the archive database and bringing its schema up to date.

``open_engine`` connects once before returning, so that a bad path, a read-only file or an
unreachable server is reported when the agent starts, as one line that names the database (with
its password hidden) and the reason, not as a traceback at the first write minutes later. It is
for the writers (the daemon, ``sustain db upgrade``, ``sustain probe --record``) and creates a
missing SQLite file and its directory. ``open_archive`` is for the commands that only read: it
creates nothing, writes nothing, and tells a missing or never-migrated archive apart from a
broken one. Every URL and driver message on their way out go through
``agent.config.database_url`` (``describe``, ``archive_error``), which hides the secrets.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, SQLAlchemyError

from agent.archive import partitions
from agent.config import database_url

if TYPE_CHECKING:  # Alembic is imported where the schema is migrated: reading needs none of it
    from alembic.config import Config

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).parent / "migrations"
SQLITE_BUSY_TIMEOUT_MS = 10_000
CONNECT_TIMEOUT_S = 10
POOL_RECYCLE_S = 300  # a pooled session lives at most this long (settings changed under it)
LOCK_TIMEOUT = "10s"  # a write waiting on another session's lock fails and is retried
STATEMENT_TIMEOUT = "60s"
READ_ONLY_SQLSTATE = "25006"  # read_only_sql_transaction: the session is stale, get a fresh one

# What psycopg puts before the reason; the URL in our message already names the server.
_NOISE = re.compile(
    r"^(?:connection failed: )?(?:connection to server at .*?, port \d+ failed: )?(?:FATAL: +)?"
)


class ArchiveError(Exception):
    """The archive database cannot be opened, migrated or written. The message is one line."""


class ArchiveUnavailable(ArchiveError):
    """The database cannot be reached or written now (a server down, a full disk, a lock): not a
    mistake in the configuration, so the daemon keeps running and tries again."""


_UNAVAILABLE = ("OperationalError", "InterfaceError", "InternalError")


def _unavailable(exc: SQLAlchemyError) -> bool:
    if isinstance(exc, DBAPIError):
        return exc.connection_invalidated or type(exc).__name__ in _UNAVAILABLE
    return True  # pool timeouts, disconnects before a statement ran


def _reason(exc: BaseException, url: URL) -> str:
    """The first line of the driver's own message, without psycopg's preamble or the secrets."""
    original = getattr(exc, "orig", None) or exc
    lines = str(original).strip().splitlines()
    reason = _NOISE.sub("", lines[0]).strip() if lines else ""
    if not reason:
        reason = type(original).__name__
    reason = database_url.scrub(reason, url)
    if reason[:1].isupper() and reason[1:2].islower():
        reason = reason[0].lower() + reason[1:]
    return reason


def describe(engine_or_url: Engine | URL) -> str:
    """The database's URL as it may appear in a log line or an error message."""
    url = engine_or_url.url if isinstance(engine_or_url, Engine) else engine_or_url
    shown = database_url.redact(url)
    # A SQLite path reads better unescaped (file: URIs).
    return unquote(shown) if url.get_backend_name() == "sqlite" else shown


def archive_error(action: str, engine_or_url: Engine | URL, exc: BaseException) -> ArchiveError:
    """``cannot <action> <url>: <reason>``, the shape of every database error the agent reports."""
    url = engine_or_url.url if isinstance(engine_or_url, Engine) else engine_or_url
    return ArchiveError(f"cannot {action} {describe(url)}: {_reason(exc, url)}")


def _sqlite_file(url: URL) -> Path | None:
    """The file behind a SQLite URL; None for an in-memory database or a ``file:`` URI."""
    database = url.database or ""
    if database in ("", ":memory:") or url.query.get("uri") == "true":
        return None
    return Path(database)


def _on_sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers (exports, Grafana) run while the agent writes; NORMAL is durable in WAL
    # except for the last commits on power loss. sqlite3 is told to keep out of transaction
    # control so that the "begin" listener below can make DDL transactional too.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.execute("PRAGMA foreign_keys = ON")
    finally:
        cursor.close()


def _on_sqlite_read_connect(dbapi_connection: Any, _record: Any) -> None:
    # A reader waits for the agent's writes like a writer does, and cannot write by mistake.
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA query_only = ON")
    finally:
        cursor.close()


def _on_sqlite_begin(connection: Connection) -> None:
    # sqlite3's own legacy transaction control skips BEGIN before DDL and SELECT, which would let
    # a migration half-apply; SQLAlchemy's documented remedy is to emit BEGIN ourselves. IMMEDIATE
    # takes the write lock up front: a deferred transaction that reads and then writes (as a
    # migration does) fails at once with "database is locked" when another writer got in between,
    # whereas IMMEDIATE waits for it under busy_timeout. Readers in other processes are not held up
    # (WAL), and the agent's own transactions are short.
    connection.exec_driver_sql("BEGIN IMMEDIATE")


def _check_sqlite_writable(connection: Connection) -> None:
    # Opening and reading succeed on a read-only file; only a write shows it. Writing the
    # user_version back unchanged inside a rolled-back transaction leaves the file as it was.
    version = connection.exec_driver_sql("PRAGMA user_version").scalar_one()
    connection.exec_driver_sql(f"PRAGMA user_version = {int(version)}")
    connection.rollback()


def _parse(url: str) -> URL:
    try:
        parsed = database_url.parse(url)
    except database_url.DatabaseUrlError as exc:
        raise ArchiveError(str(exc)) from None
    if parsed.get_backend_name() not in database_url.SUPPORTED_BACKENDS:
        raise ArchiveError(
            f"unsupported database {describe(parsed)}: the archive runs on sqlite or postgresql"
        )
    return parsed


def _create_engine(parsed: URL, **options: Any) -> Engine:
    try:
        return create_engine(parsed, **options)
    except ImportError as exc:  # the DBAPI module is imported here
        driver = parsed.get_driver_name()
        install = " (install sustain[postgres])" if driver == "psycopg" else ""
        raise ArchiveError(
            f"cannot use database {describe(parsed)}: its driver {driver} is not installed{install}"
        ) from exc
    except (ArgumentError, NoSuchModuleError) as exc:
        raise archive_error("use database", parsed, exc) from exc


def _postgresql_engine(parsed: URL) -> Engine:
    # A server that drops packets must fail start-up in seconds, not hang it. No server-side
    # prepared statements (psycopg prepares a query after 5 runs): behind PgBouncer in
    # transaction mode, how a fleet shares its connections (docs/scale.md), the next transaction
    # may run on another server connection, where the statement is missing or taken, and the
    # error would set the item aside as rejected. What they save, a parse and plan of each
    # statement, is small beside the round trips and the commit.
    #
    # Pooled sessions do not live forever (pool_recycle): a session keeps the settings it started
    # with (``ALTER DATABASE ... SET default_transaction_read_only`` and its reset reach only new
    # ones), and one that finds itself read-only is dropped with the whole pool (_on_error). Lock
    # and statement timeouts are set on each new session with SET rather than a startup
    # ``options`` packet, which PgBouncer refuses unless told to ignore it.
    engine = _create_engine(
        parsed,
        pool_pre_ping=True,
        pool_recycle=POOL_RECYCLE_S,
        connect_args={"connect_timeout": CONNECT_TIMEOUT_S, "prepare_threshold": None},
    )
    event.listen(engine, "connect", _on_postgresql_connect)
    event.listen(engine, "handle_error", _on_error)
    return engine


def _on_postgresql_connect(dbapi_connection: Any, _record: Any) -> None:
    autocommit = dbapi_connection.autocommit
    dbapi_connection.autocommit = True
    try:
        with dbapi_connection.cursor() as cursor:
            cursor.execute(f"SET lock_timeout = '{LOCK_TIMEOUT}'")
            cursor.execute(f"SET statement_timeout = '{STATEMENT_TIMEOUT}'")
    finally:
        dbapi_connection.autocommit = autocommit


def _on_error(context: Any) -> None:
    sqlstate = getattr(context.original_exception, "sqlstate", None)
    if sqlstate == READ_ONLY_SQLSTATE:
        context.is_disconnect = True  # invalidates the session (and the pool): retried fresh


def _create_directory(directory: Path) -> None:
    if directory.is_dir():
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        # mkdir reports a file in the way as "File exists", which reads as if all were well.
        in_the_way = isinstance(exc, FileExistsError)
        reason = os.strerror(errno.ENOTDIR) if in_the_way else exc.strerror
        raise ArchiveError(f"cannot create directory {directory}: {reason}") from exc
    log.info("created directory %s for the archive", directory)


def open_engine(url: str) -> Engine:
    """An engine on the archive database, known to be reachable (and writable, for SQLite)."""
    engine = make_engine(url)
    check_engine(engine)
    return engine


def make_engine(url: str, *, create_directory: bool = True) -> Engine:
    """An engine on the archive database, not yet connected: an ArchiveError here is a mistake
    in the configuration (the URL, the driver, a file where a directory should be), an
    ArchiveUnavailable a directory that cannot be made now (a full or read-only disk)."""
    parsed = _parse(url)
    backend = parsed.get_backend_name()
    path = _sqlite_file(parsed) if backend == "sqlite" else None
    if path is not None and create_directory:
        try:
            _create_directory(path.parent)
        except ArchiveError as exc:
            if isinstance(exc.__cause__, OSError) and exc.__cause__.errno in (
                errno.ENOSPC,
                errno.EIO,
                errno.EROFS,
            ):
                raise ArchiveUnavailable(str(exc)) from exc
            raise
    if backend == "sqlite":
        engine = _create_engine(parsed)
        event.listen(engine, "connect", _on_sqlite_connect)
        event.listen(engine, "begin", _on_sqlite_begin)
    else:
        engine = _postgresql_engine(parsed)
        # The monthly partitions a committed transaction made exist for good; see partitions.
        event.listen(engine, "commit", partitions.remember)
        event.listen(engine, "rollback", partitions.forget)
    return engine


def check_engine(engine: Engine) -> None:
    """Connect once (and for SQLite, show the file writable); ArchiveUnavailable when not."""
    sqlite = engine.dialect.name == "sqlite"
    path = _sqlite_file(engine.url) if sqlite else None
    try:
        if path is not None:
            _create_directory(path.parent)
        with engine.connect() as connection:
            if sqlite:
                _check_sqlite_writable(connection)
    except SQLAlchemyError as exc:
        engine.dispose()
        action = "open database" if sqlite else "connect to database"
        error = archive_error(action, engine, exc)
        raise ArchiveUnavailable(str(error)) from exc
    except ArchiveError as exc:
        raise ArchiveUnavailable(str(exc)) from exc


def _no_archive(url: URL) -> ArchiveError:
    return ArchiveError(f"no sustain archive here: run `sustain db upgrade` ({describe(url)})")


def _sqlite_reader(parsed: URL, path: Path) -> Engine:
    """An engine that can neither create ``path`` (``mode=rw``) nor write to it (query_only)."""
    if not path.is_file():
        raise _no_archive(parsed)
    # mode=rw rather than mode=ro: a read-only connection cannot remove the -wal and -shm files
    # it opens beside a WAL database, whereas the last read-write one to close does. SQLite opens
    # a write-protected file read-only all the same.
    uri = f"{path.absolute().as_uri()}?mode=rw"
    engine = _create_engine(
        parsed, creator=lambda: sqlite3.connect(uri, uri=True, check_same_thread=False)
    )
    event.listen(engine, "connect", _on_sqlite_read_connect)
    return engine


def open_archive(url: str) -> Engine:
    """An engine on an existing archive, for reading; an ArchiveError where there is none.

    Nothing is created or written: a missing SQLite file stays missing and the file of a
    never-migrated one is left as it was.
    """
    parsed = _parse(url)
    path = _sqlite_file(parsed) if parsed.get_backend_name() == "sqlite" else None
    if path is not None:
        engine = _sqlite_reader(parsed, path)
    elif parsed.get_backend_name() == "sqlite":
        engine = _create_engine(parsed)  # in memory, or a file: URI that says how to open it
    else:
        engine = _postgresql_engine(parsed)
    try:
        with engine.connect() as connection:
            revision = _revision(connection)
    except SQLAlchemyError as exc:
        engine.dispose()
        sqlite = parsed.get_backend_name() == "sqlite"
        action = "open database" if sqlite else "connect to database"
        raise archive_error(action, parsed, exc) from exc
    if revision is None:
        engine.dispose()
        raise _no_archive(parsed)
    return engine


def _revision(connection: Connection) -> str | None:
    """The revision Alembic recorded (its table ``alembic_version``, one row), None where the
    database was never migrated: read without Alembic, whose import costs a command that only
    reads the archive a noticeable part of its start."""
    if not inspect(connection).has_table("alembic_version"):
        return None
    return connection.execute(text("SELECT version_num FROM alembic_version")).scalar()


def _alembic_config(connection: Connection | None = None) -> Config:
    from alembic.config import Config

    # No ini file: the agent must not let Alembic configure logging, and the migrations are found
    # next to this module wherever the package is installed.
    config = Config()
    config.set_main_option("script_location", os.fspath(MIGRATIONS).replace("%", "%%"))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply the pending migrations in one transaction (per database; see migrations/env.py).

    Never a downgrade: a ``revision`` older than the database's is an ArchiveError, where
    Alembic would do nothing and the caller would report success.
    """
    from alembic import command
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    script = ScriptDirectory.from_config(_alembic_config())
    known = [s.revision for s in script.walk_revisions()]  # newest first; the history is linear
    try:
        found = script.get_revision(revision)  # an id, a unique prefix of one, or head
    except CommandError:
        found = None
    if found is None:
        raise ArchiveError(
            f"unknown revision {revision!r}: this sustain has {known[-1]} to {known[0]}, or head"
        )
    target = found.revision
    try:
        with engine.begin() as connection:
            current = _revision(connection)
            if current is not None and current not in known:
                raise ArchiveError(
                    f"database {describe(engine)} is at revision {current}, which this sustain "
                    f"does not have (its newest is {known[0]}): upgrade sustain"
                )
            if current is not None and known.index(target) > known.index(current):
                raise ArchiveError(
                    f"database {describe(engine)} is at revision {current}, newer than {target}: "
                    "sustain never downgrades the archive"
                )
            command.upgrade(_alembic_config(connection), target)
            if connection.dialect.name == "postgresql" and partitions.is_partitioned(
                connection, "probe_runs"
            ):
                # This month's partitions and the next ones, before the first write needs them.
                partitions.ensure_around(connection, datetime.now(UTC))
    except SQLAlchemyError as exc:
        error = archive_error("migrate database", engine, exc)
        raise (ArchiveUnavailable(str(error)) if _unavailable(exc) else error) from exc
    except CommandError as exc:  # a revision this agent lacks
        raise archive_error("migrate database", engine, exc) from exc


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at; None for a database that was never migrated."""
    try:
        with engine.connect() as connection:
            return _revision(connection)
    except SQLAlchemyError as exc:
        raise ArchiveUnavailable(str(archive_error("read database", engine, exc))) from exc


def head_revision() -> str | None:
    """The newest revision this version of the agent ships, to compare with ``current_revision``."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_alembic_config()).get_current_head()
