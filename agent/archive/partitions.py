"""Monthly partitions of the fleet's high-volume tables on PostgreSQL.

A fleet database grows by millions of rows a day; deleting old rows one by one (what SQLite
retention does, and what PostgreSQL did before migration 0010) scans and bloats the tables.
PostgreSQL's declarative partitioning splits each of ``PARTITIONED`` by month of its time column,
so that retention drops a whole month at a time (``drop_older_than``) and the planner reads only
the months a query's time range touches.

A partition must exist before a row of its month can be written. ``ensure`` creates the months
around now when the schema is migrated and at every retention pass, and the writers call
``ensure_for`` with the times they are about to write (a spool replayed after a long outage, a
clock far off), which costs a set lookup once the month is known to this process.

SQLite keeps plain tables: nothing here runs there.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Connection, text

from agent.archive import fleet_baselines, summary

log = logging.getLogger(__name__)

PARTITIONED = {
    "telemetry_rollups": "period_start",
    "events": "occurred_at",
    "probe_runs": "started_at",
    "probe_series": "started_at",
}
"""Each partitioned table and the time column it is partitioned by."""

MONTHS_AHEAD = 2
"""Months after the current one whose partitions exist in advance."""

# A partition's name: its table, then _pYYYYMM. Alembic must not take them for tables of its own.
_NAME = re.compile(r"^(?P<table>[a-z_]+)_p(?P<year>\d{4})(?P<month>\d{2})$")
DEFAULT_SUFFIX = "_default"
"""Each table's DEFAULT partition: where a row of a month without its own partition lands when
it was not written through the agent's writers (a bulk load, a tool). The next ``ensure`` of
that month moves its rows into the month's own partition."""

# Partitions are created by whichever agent writes first; this transaction-scoped lock makes
# concurrent creators of one month take turns (the bytes of "sustainP").
PARTITION_LOCK_KEY = 0x7375737461696E50


Month = tuple[int, int]


def month_of(when: datetime) -> Month:
    when = when.astimezone(UTC)
    return when.year, when.month


def _next(month: Month) -> Month:
    year, number = month
    return (year + 1, 1) if number == 12 else (year, number + 1)


def _start(month: Month) -> datetime:
    return datetime(month[0], month[1], 1, tzinfo=UTC)


def partition_name(table: str, month: Month) -> str:
    return f"{table}_p{month[0]:04d}{month[1]:02d}"


def is_partition(name: str) -> bool:
    """Whether ``name`` is one of our partitions (for Alembic's ``include_name``)."""
    if name.endswith(DEFAULT_SUFFIX) and name.removesuffix(DEFAULT_SUFFIX) in PARTITIONED:
        return True
    found = _NAME.match(name)
    return found is not None and found.group("table") in PARTITIONED


@dataclass(frozen=True, slots=True)
class Partition:
    table: str
    name: str
    month: Month

    @property
    def end(self) -> datetime:
        """The first instant after the partition's month."""
        return _start(_next(self.month))


_known: set[tuple[str, str, Month]] = set()
_known_lock = threading.Lock()


def _database(connection: Connection) -> str:
    return connection.engine.url.render_as_string(hide_password=True)


def is_partitioned(connection: Connection, table: str) -> bool:
    query = text("SELECT 1 FROM pg_partitioned_table WHERE partrelid = to_regclass(:table)")
    return connection.execute(query, {"table": table}).first() is not None


def ensure(connection: Connection, table: str, months: Iterable[Month]) -> list[str]:
    """Create the partitions of ``table`` for ``months`` that do not exist yet; their names."""
    database = _database(connection)
    wanted = sorted({m for m in months if (database, table, m) not in _known})
    if not wanted:
        return []
    created: list[str] = []
    connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": PARTITION_LOCK_KEY})
    for month in wanted:
        name = partition_name(table, month)
        if connection.execute(text("SELECT to_regclass(:name)"), {"name": name}).scalar():
            continue
        _create(connection, table, month)
        created.append(name)
    # Known only once this transaction commits: on a rollback the next write tries again.
    connection.info.setdefault("sustain_partitions", set()).update(
        (database, table, m) for m in wanted
    )
    return created


def _create(connection: Connection, table: str, month: Month) -> None:
    """The month's partition; rows of it in the DEFAULT partition move into it (PostgreSQL
    refuses to create a partition while the default one holds rows of its range)."""
    name, default = partition_name(table, month), f"{table}{DEFAULT_SUFFIX}"
    column = PARTITIONED[table]
    start, end = _start(month), _start(_next(month))
    bounds = f"FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')"
    strays = connection.execute(
        text(
            f'SELECT EXISTS (SELECT 1 FROM "{default}" '
            f"WHERE {column} >= :start AND {column} < :end)"
        ),
        {"start": start, "end": end},
    ).scalar()
    if not strays:
        connection.exec_driver_sql(f'CREATE TABLE "{name}" PARTITION OF "{table}" {bounds}')
    else:
        range_ = f"{column} >= '{start.isoformat()}' AND {column} < '{end.isoformat()}'"
        connection.exec_driver_sql(
            f"CREATE TEMPORARY TABLE sustain_strays ON COMMIT DROP AS "
            f'SELECT * FROM "{default}" WHERE {range_}'
        )
        connection.exec_driver_sql(f'DELETE FROM "{default}" WHERE {range_}')
        connection.exec_driver_sql(f'CREATE TABLE "{name}" PARTITION OF "{table}" {bounds}')
        connection.exec_driver_sql(f'INSERT INTO "{table}" SELECT * FROM sustain_strays')
        connection.exec_driver_sql("DROP TABLE sustain_strays")
    log.info("created partition %s of %s (%s to %s)", name, table, start, end)


def adopt_strays(connection: Connection, table: str) -> list[str]:
    """Give every month with rows in ``table``'s DEFAULT partition its own partition (so that
    retention can drop it); the partitions made."""
    column = PARTITIONED[table]
    months = {
        (int(year), int(month))
        for year, month in connection.execute(
            text(
                f"SELECT DISTINCT extract(year FROM {column} AT TIME ZONE 'UTC'), "
                f"extract(month FROM {column} AT TIME ZONE 'UTC') "
                f'FROM "{table}{DEFAULT_SUFFIX}"'
            )
        )
    }
    return ensure(connection, table, months) if months else []


def remember(connection: Connection) -> None:
    """After a commit: the partitions ``ensure`` made or found in it now exist for good."""
    with _known_lock:
        _known.update(connection.info.pop("sustain_partitions", set()))


def forget(connection: Connection) -> None:
    """After a rollback: what ``ensure`` made in the transaction is gone with it."""
    connection.info.pop("sustain_partitions", None)


def ensure_for(connection: Connection, table: str, times: Iterable[datetime]) -> None:
    """Make sure the partitions for rows at ``times`` exist (PostgreSQL; nothing on SQLite)."""
    if connection.dialect.name != "postgresql":
        return
    ensure(connection, table, {month_of(when) for when in times})


def ensure_around(connection: Connection, now: datetime, tables: Iterable[str] = ()) -> list[str]:
    """The current and next ``MONTHS_AHEAD`` months of every partitioned table (an older month
    is made when a row of it comes: ``ensure_for``)."""
    month = month_of(now)
    months = [month]
    for _ in range(MONTHS_AHEAD):
        month = _next(month)
        months.append(month)
    created: list[str] = []
    for table in tables or PARTITIONED:
        created += ensure(connection, table, months)
    return created


def partitions(connection: Connection, table: str) -> list[Partition]:
    """The monthly partitions of ``table``, oldest first."""
    query = text(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = to_regclass(:table)"
    )
    found = []
    for name in connection.execute(query, {"table": table}).scalars():
        match = _NAME.match(name)
        if match is not None and match.group("table") == table:
            month = (int(match.group("year")), int(match.group("month")))
            found.append(Partition(table, name, month))
    return sorted(found, key=lambda p: p.month)


def drop_older_than(connection: Connection, table: str, cutoff: datetime) -> list[Partition]:
    """Drop the partitions of ``table`` whose whole month is before ``cutoff``; those dropped.

    Never a DELETE: a partition goes with its rows, its indexes and its dead tuples at once.
    """
    dropped = [p for p in partitions(connection, table) if p.end <= cutoff]
    database = _database(connection)
    for partition in dropped:
        connection.exec_driver_sql(f'DROP TABLE "{partition.name}"')
        with _known_lock:
            _known.discard((database, table, partition.month))
    return dropped


def oldest_kept(connection: Connection, table: str) -> datetime | None:
    """The start of ``table``'s oldest partition: nothing older is kept."""
    found = partitions(connection, table)
    return _start(found[0].month) if found else None


# Objects that only PostgreSQL has, made by migrations 0010 and 0012 outside the models.
POSTGRESQL_ONLY = frozenset(
    {
        *summary.TABLES,
        *summary.INDEXES,
        *summary.RANK_INDEXES.values(),
        fleet_baselines.TABLE,
        fleet_baselines.SERIES_INDEX,
    }
)


def include_name(name: str | None, type_: str, parent_names: object) -> bool:
    """Alembic's ``include_name``: the models describe neither the monthly partitions nor the
    PostgreSQL-only summary (agent.archive.summary), so autogenerate must not see them."""
    if name is None:
        return True
    if type_ == "table" and is_partition(name):
        return False
    return name not in POSTGRESQL_ONLY
