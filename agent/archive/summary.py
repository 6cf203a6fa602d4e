"""The summary of probe results on PostgreSQL, kept by the database itself.

``sustain capacity`` over a fleet's whole history must not read every result: at 10,000 nodes the
archive holds tens of millions. Tables written by a trigger on ``probe_runs`` in the same
transaction as the run (so they can never disagree with it, whichever agent version wrote the
run) answer the counts and locate the quantiles. Four per basis (``BASES``: the results with a
steady value, and since migration 0011 the ok runs without a steady state, counted on their p10
over one-second windows), named ``probe_result_<kind>`` for the steady basis and
``probe_result_p10_<kind>`` for the p10 one:

``probe_result_days``
    per day (of ``ended_at``, UTC), grouping (``model`` or ``stack``, the group's value), probe
    (workload, precision, optimization, unit, size, scope) and value bucket: the number of
    results. A bucket is ``floor(ln(value) / ln(1 + BUCKET_WIDTH))``: buckets 0.1% wide, in
    value order.
``probe_result_buckets``
    the same without the day: the whole history's counts, so that a query without ``--since``
    reads a row per group and bucket, however many days the archive holds.
``probe_result_devices``
    per grouping, group, probe and device: the device's model and its latest result. The devices
    behind a group since a time are those whose latest result is at or after it.
``probe_result_groups``
    per grouping, group and probe: its devices (and the least and greatest model among them),
    for a query without ``--since``.
``probe_result_devices_by_day`` (migration 0013)
    per grouping, group, probe, day and model: the number of devices whose latest result ended
    on that day. The devices behind a group since a time are those of the days after its own,
    summed, and of its own day those whose latest result is at or after it, read from
    ``probe_result_devices`` by ``last_ended_at`` (a day's devices at most): a few rows a group
    and day, where the devices table holds a row per device, group and probe (2.6 million at
    10 million results).

and one more for the runs left out (migration 0011):

``probe_result_left_out_days``
    per day (of ``ended_at``; an aborted run, whose end was never recorded, by its start), probe
    and reason (``failed``, ``timeout``, ``aborted``, ``preempted``, ``insufficient``,
    ``no_figure``): the number of runs. A few rows a probe and day, read whole.

The rest of the first day of a ``--since`` is counted from the runs through
``ix_probe_runs_period_ended_at`` (and the runs left out through ``ix_probe_runs_period_left_out``,
on the instant they count at), PostgreSQL-only indexes of migration 0013: a day's runs, where
without them every month's partition was read whole.

From the counts alone the query finds the bucket that holds each quantile's rank (and the next
rank's, where the two differ), then reads the exact value from the results of that one bucket
through an index in (group, bucket, ended_at) order that holds the value
(``ix_probe_runs_rank_by_*``, ``ix_probe_runs_rank_p10_by_*``; migration 0014 put ``ended_at``
before the value): a bucket's results, or a period's part of them, are one range of it, sorted
by value in memory. The answer is the unsummarised query's, to the last bit.

They are PostgreSQL only (SQLite has no such fleet, and keeps its index-walking query), which is
why they are not among the models: migrations/env.py leaves them out of Alembic's comparison.
NULL keys are stored as '' so that the unique keys match them; no key is '' otherwise. A
deleted result (retention drops whole months, which ``trim`` follows) is uncounted, but its
device is not forgotten until ``trim``: the device counts are those of devices ever seen.
Migration 0010 made the steady basis's tables; 0011 adds the p10 basis's and the runs left out
(``create`` and ``drop`` take the parts, and the trigger always keeps those that exist); 0013 the
devices by day and the period indexes (``create_by_day``, ``drop_by_day``); 0014 remakes the rank
indexes (``remake_rank_indexes``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import Connection, TextClause, text

from agent.archive.models import LEFT_OUT_SQL, P10_RESULTS_SQL, RESULTS_SQL

BUCKET_WIDTH = 0.001
"""Relative width of a value bucket: a bucket holds about 1/60 of a group whose results spread
over 6%, which is what the exact read of a quantile walks."""

NO_BUCKET = -(2**31)
"""The bucket of a value whose logarithm does not exist (zero, negative): below all others."""

PROBE_KEYS = ("workload", "precision", "optimization", "unit", "size", "scope")
"""A result's probe, in the summary tables' key order; unit and size may be NULL in runs."""

GROUP_KEYS = ("precision", "workload", "optimization", "unit", "size", "scope")
"""The same in the order of agent.archive.models.RESULT_GROUP, which ``sustain capacity`` keys
its groups by: the order of every row these queries return."""

GROUPINGS = {"model": "device_model", "stack": "stack_id"}
"""The groupings the summary serves, and the column of probe_runs each groups by."""

BASES = ("steady", "p10")
"""What a result counts on: its steady value, or (a run without a steady state) its p10."""

RESULTS_WHERE = RESULTS_SQL
WHERES = {"steady": RESULTS_SQL, "p10": P10_RESULTS_SQL}
"""The runs of each basis (agent.archive.models)."""

VALUES = {"steady": "steady_throughput", "p10": "p10_throughput"}
"""The column that holds each basis's figure."""

LEFT_OUT_TABLE = "probe_result_left_out_days"


def table_of(basis: str, kind: str) -> str:
    """The table of ``kind`` (days, buckets, devices, groups) of ``basis``."""
    return f"probe_result_{kind}" if basis == "steady" else f"probe_result_{basis}_{kind}"


def _rank_index(basis: str, grouping: str) -> str:
    infix = "" if basis == "steady" else f"{basis}_"
    return f"ix_probe_runs_rank_{infix}by_{grouping}"


KINDS = ("days", "buckets", "devices", "groups")
BY_DAY = "devices_by_day"
"""The kind of the devices by the day of their latest result (migration 0013): not among
``KINDS``, which migrations 0010 and 0011 make."""
RANK_INDEXES = {
    (basis, grouping): _rank_index(basis, grouping) for basis in BASES for grouping in GROUPINGS
}
"""PostgreSQL-only indexes for reading a quantile's exact value within its bucket."""

TABLES = (
    *(table_of(basis, kind) for basis in BASES for kind in (*KINDS, BY_DAY)),
    LEFT_OUT_TABLE,
)

PERIOD_INDEXES = {
    "ix_probe_runs_period_ended_at": "CREATE INDEX ix_probe_runs_period_ended_at ON probe_runs "
    "(ended_at)",
    "ix_probe_runs_period_left_out": "CREATE INDEX ix_probe_runs_period_left_out ON probe_runs "
    f"((coalesce(ended_at, started_at))) WHERE {LEFT_OUT_SQL}",
}
"""PostgreSQL-only indexes of the runs by the instant they count at (migration 0013): the rest
of a ``--since``'s first day read from the runs, a day's runs rather than every partition."""

INDEXES = (
    *(
        name
        for basis in BASES
        for name in (
            f"ix_{table_of(basis, 'days')}_day",
            f"ix_{table_of(basis, 'devices')}_last_ended_at",
        )
    ),
    f"ix_{LEFT_OUT_TABLE}_day",
    *PERIOD_INDEXES,
)

BUCKET_FUNCTION = f"""
CREATE OR REPLACE FUNCTION sustain_result_bucket(value double precision) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE RETURNS NULL ON NULL INPUT AS $$
  SELECT CASE WHEN value > 0 AND value < 'Infinity'::double precision
              THEN floor(ln(value) / ln({1 + BUCKET_WIDTH!r}::double precision))::integer
              ELSE {NO_BUCKET} END
$$
"""

_KEYS = ", ".join(PROBE_KEYS)
_KEY_COLUMNS = ", ".join(f"{name} varchar(32) NOT NULL" for name in PROBE_KEYS)
_GROUP_COLUMNS = "grouping varchar(8) NOT NULL, group_value varchar(128) NOT NULL"
_RUN_COLUMNS = re.compile(r"\b(outcome|steady_throughput|p10_throughput|classification)\b")


def _on(condition: str, row: str) -> str:
    """``condition`` (on probe_runs' columns) for the row ``row`` (``NEW``, ``OLD``, ``r``)."""
    return _RUN_COLUMNS.sub(rf"{row}.\1", f"({condition})")


def _create_tables(basis: str) -> tuple[str, ...]:
    days, buckets, devices, groups = (table_of(basis, kind) for kind in KINDS)
    return (
        f"""
CREATE TABLE {days} (
  day date NOT NULL, {_GROUP_COLUMNS}, {_KEY_COLUMNS},
  bucket integer NOT NULL, results bigint NOT NULL,
  CONSTRAINT pk_{days} PRIMARY KEY (grouping, {_KEYS}, group_value, day, bucket)
)
""",
        f"CREATE INDEX ix_{days}_day ON {days} (day)",
        f"""
CREATE TABLE {buckets} (
  {_GROUP_COLUMNS}, {_KEY_COLUMNS}, bucket integer NOT NULL, results bigint NOT NULL,
  CONSTRAINT pk_{buckets} PRIMARY KEY (grouping, {_KEYS}, group_value, bucket)
)
""",
        f"""
CREATE TABLE {devices} (
  {_GROUP_COLUMNS}, {_KEY_COLUMNS},
  node varchar(255) NOT NULL, device varchar(128) NOT NULL, device_model varchar(128) NOT NULL,
  last_ended_at timestamp with time zone NOT NULL,
  CONSTRAINT pk_{devices} PRIMARY KEY
    (grouping, {_KEYS}, group_value, node, device, device_model)
)
""",
        f"CREATE INDEX ix_{devices}_last_ended_at ON {devices} (last_ended_at)",
        f"""
CREATE TABLE {groups} (
  {_GROUP_COLUMNS}, {_KEY_COLUMNS}, devices bigint NOT NULL,
  low_model varchar(128) NOT NULL, high_model varchar(128) NOT NULL,
  CONSTRAINT pk_{groups} PRIMARY KEY (grouping, {_KEYS}, group_value)
)
""",
    )


def _create_by_day(basis: str) -> str:
    by_day = table_of(basis, BY_DAY)
    return f"""
CREATE TABLE {by_day} (
  {_GROUP_COLUMNS}, {_KEY_COLUMNS}, day date NOT NULL, device_model varchar(128) NOT NULL,
  devices bigint NOT NULL,
  CONSTRAINT pk_{by_day} PRIMARY KEY (grouping, {_KEYS}, group_value, day, device_model)
)
"""


CREATE_LEFT_OUT = (
    f"""
CREATE TABLE {LEFT_OUT_TABLE} (
  day date NOT NULL, {_KEY_COLUMNS}, reason varchar(16) NOT NULL, runs bigint NOT NULL,
  CONSTRAINT pk_{LEFT_OUT_TABLE} PRIMARY KEY ({_KEYS}, reason, day)
)
""",
    f"CREATE INDEX ix_{LEFT_OUT_TABLE}_day ON {LEFT_OUT_TABLE} (day)",
)


def _keys(row: str) -> str:
    return ", ".join(f"coalesce({row}.{name}, '')" for name in PROBE_KEYS)


def _day(row: str) -> str:
    return f"({row}.ended_at AT TIME ZONE 'UTC')::date"


def _left_out_day(row: str) -> str:
    """The day a run left out counts on: its end's, or an aborted run's start's (no end)."""
    return f"(coalesce({row}.ended_at, {row}.started_at) AT TIME ZONE 'UTC')::date"


def _reason(row: str) -> str:
    """Why the run ``row`` is left out (agent.reports.capacity.left_out_reason); NULL if not."""
    return (
        f"CASE WHEN {_on(LEFT_OUT_SQL, row)} THEN CASE WHEN {row}.outcome <> 'ok' "
        f"THEN {row}.outcome WHEN {row}.classification = 'insufficient' THEN 'insufficient' "
        "ELSE 'no_figure' END END"
    )


_GROUP_OF = {grouping: f"coalesce(r.{column}, '')" for grouping, column in GROUPINGS.items()}

_COLUMNS_DAYS = f"day, grouping, group_value, {_KEYS}, bucket, results"
_COLUMNS_BUCKETS = f"grouping, group_value, {_KEYS}, bucket, results"
_COLUMNS_DEVICES = f"grouping, group_value, {_KEYS}, node, device, device_model, last_ended_at"
_COLUMNS_GROUPS = f"grouping, group_value, {_KEYS}, devices, low_model, high_model"
_COLUMNS_LEFT_OUT = f"day, {_KEYS}, reason, runs"
_COLUMNS_BY_DAY = f"grouping, group_value, {_KEYS}, day, device_model, devices"
_DAYS_KEY = f"grouping, {_KEYS}, group_value, day, bucket"
_BUCKETS_KEY = f"grouping, {_KEYS}, group_value, bucket"
_DEVICES_KEY = f"grouping, {_KEYS}, group_value, node, device, device_model"
_GROUPS_KEY = f"grouping, {_KEYS}, group_value"
_LEFT_OUT_KEY = f"{_KEYS}, reason, day"
_BY_DAY_KEY = f"grouping, {_KEYS}, group_value, day, device_model"


def _match(row: str, value: str) -> str:
    """In the trigger: the summary row of grouping ``g`` (value ``gv``) and bucket of ``value``
    that the run ``row`` counts in."""
    return " AND ".join(
        [
            "grouping = g",
            "group_value = gv",
            *(f"{name} = coalesce({row}.{name}, '')" for name in PROBE_KEYS),
            f"bucket = sustain_result_bucket({value})",
        ]
    )


def _group_value(row: str) -> str:
    return (
        f"CASE g WHEN 'model' THEN coalesce({row}.device_model, '') "
        f"ELSE coalesce({row}.stack_id, '') END"
    )


def _uncount(basis: str) -> str:
    days, buckets = table_of(basis, "days"), table_of(basis, "buckets")
    match = _match("OLD", f"OLD.{VALUES[basis]}")
    return f"""
  IF TG_OP IN ('UPDATE', 'DELETE') AND {_on(WHERES[basis], "OLD")}
     AND OLD.ended_at IS NOT NULL THEN
    FOREACH g IN ARRAY ARRAY['model', 'stack'] LOOP
      gv := {_group_value("OLD")};
      UPDATE {days} SET results = results - 1 WHERE day = {_day("OLD")} AND {match};
      UPDATE {buckets} SET results = results - 1 WHERE {match};
    END LOOP;
  END IF;"""


def _date(instant: str) -> str:
    return f"({instant} AT TIME ZONE 'UTC')::date"


def _device_key(row: str) -> str:
    """In the trigger: the devices table's row of the device of ``row`` in group ``gv``."""
    return " AND ".join(
        [
            "grouping = g",
            "group_value = gv",
            *(f"{name} = coalesce({row}.{name}, '')" for name in PROBE_KEYS),
            f"node = {row}.node",
            f"device = {row}.device",
            f"device_model = coalesce({row}.device_model, '')",
        ]
    )


def _by_day_add(basis: str, day: str, change: int) -> str:
    """In the trigger: add ``change`` to the devices of NEW's group whose latest result ended
    on ``day``."""
    by_day = table_of(basis, BY_DAY)
    return (
        f"INSERT INTO {by_day} ({_COLUMNS_BY_DAY}) "
        f"VALUES (g, gv, {_keys('NEW')}, {day}, coalesce(NEW.device_model, ''), {change}) "
        f"ON CONFLICT ({_BY_DAY_KEY}) DO UPDATE SET devices = {by_day}.devices + {change};"
    )


def _group_gains_device(basis: str) -> str:
    groups = table_of(basis, "groups")
    return f"""
        INSERT INTO {groups} ({_COLUMNS_GROUPS})
          VALUES (g, gv, {_keys("NEW")}, 1, coalesce(NEW.device_model, ''),
                  coalesce(NEW.device_model, ''))
          ON CONFLICT ({_GROUPS_KEY}) DO UPDATE SET
            devices = {groups}.devices + 1,
            low_model = least({groups}.low_model, EXCLUDED.low_model),
            high_model = greatest({groups}.high_model, EXCLUDED.high_model);"""


def _count_device(basis: str, by_day: bool) -> str:
    """In the trigger: NEW's device in its group (``probe_result_devices``), a device new to the
    group counted in ``probe_result_groups``; with ``by_day``, the device moved to the day of its
    latest result. The device's row is read locked first (made if there is none; read again if
    another transaction made it first), so that the day it leaves is the one it was counted on."""
    devices = table_of(basis, "devices")
    insert = (
        f"INSERT INTO {devices} ({_COLUMNS_DEVICES}) "
        f"VALUES (g, gv, {_keys('NEW')}, NEW.node, NEW.device, coalesce(NEW.device_model, ''), "
        "NEW.ended_at)"
    )
    if not by_day:
        return f"""
      {insert}
        ON CONFLICT ({_DEVICES_KEY}) DO UPDATE
          SET last_ended_at = greatest({devices}.last_ended_at, EXCLUDED.last_ended_at)
        RETURNING (xmax = 0) INTO fresh;
      IF fresh THEN  -- a device new to the group{_group_gains_device(basis)}
      END IF;"""
    return f"""
      LOOP
        SELECT last_ended_at INTO latest FROM {devices} WHERE {_device_key("NEW")} FOR UPDATE;
        fresh := NOT FOUND;
        EXIT WHEN NOT fresh;
        {insert} ON CONFLICT DO NOTHING;
        EXIT WHEN FOUND;
      END LOOP;
      IF fresh THEN  -- a device new to the group
        {_by_day_add(basis, _date("NEW.ended_at"), 1)}{_group_gains_device(basis)}
      ELSIF NEW.ended_at > latest THEN
        UPDATE {devices} SET last_ended_at = NEW.ended_at WHERE {_device_key("NEW")};
        IF {_date("NEW.ended_at")} <> {_date("latest")} THEN
          {_by_day_add(basis, _date("latest"), -1)}
          {_by_day_add(basis, _date("NEW.ended_at"), 1)}
        END IF;
      END IF;"""


def _count(basis: str, by_day: bool) -> str:
    days, buckets = table_of(basis, "days"), table_of(basis, "buckets")
    bucket = f"sustain_result_bucket(NEW.{VALUES[basis]})"
    device = _count_device(basis, by_day)
    return f"""
  IF TG_OP IN ('INSERT', 'UPDATE') AND {_on(WHERES[basis], "NEW")}
     AND NEW.ended_at IS NOT NULL THEN
    FOREACH g IN ARRAY ARRAY['model', 'stack'] LOOP
      gv := {_group_value("NEW")};
      INSERT INTO {days} ({_COLUMNS_DAYS})
        VALUES ({_day("NEW")}, g, gv, {_keys("NEW")}, {bucket}, 1)
        ON CONFLICT ({_DAYS_KEY}) DO UPDATE SET results = {days}.results + 1;
      INSERT INTO {buckets} ({_COLUMNS_BUCKETS})
        VALUES (g, gv, {_keys("NEW")}, {bucket}, 1)
        ON CONFLICT ({_BUCKETS_KEY}) DO UPDATE SET results = {buckets}.results + 1;{device}
    END LOOP;
  END IF;"""


_LEFT_OUT_MATCH = " AND ".join(
    [f"{name} = coalesce(OLD.{name}, '')" for name in PROBE_KEYS] + ["reason = why"]
)
_TRIGGER_LEFT_OUT = f"""
  IF TG_OP IN ('UPDATE', 'DELETE') THEN
    why := {_reason("OLD")};
    IF why IS NOT NULL THEN
      UPDATE {LEFT_OUT_TABLE} SET runs = runs - 1
        WHERE day = {_left_out_day("OLD")} AND {_LEFT_OUT_MATCH};
    END IF;
  END IF;
  IF TG_OP IN ('INSERT', 'UPDATE') THEN
    why := {_reason("NEW")};
    IF why IS NOT NULL THEN
      INSERT INTO {LEFT_OUT_TABLE} ({_COLUMNS_LEFT_OUT})
        VALUES ({_left_out_day("NEW")}, {_keys("NEW")}, why, 1)
        ON CONFLICT ({_LEFT_OUT_KEY}) DO UPDATE SET runs = {LEFT_OUT_TABLE}.runs + 1;
    END IF;
  END IF;"""


def trigger_function(bases: Sequence[str], left_out: bool, by_day: bool = False) -> str:
    """The trigger's function, keeping the tables of ``bases`` (and of the runs left out; with
    ``by_day``, the devices by day of each of ``bases``).

    A result that was counted and is changed or removed is uncounted first (a replayed finish
    rewrites the same values: uncounted, then counted again); so is a run left out.
    """
    blocks = [_uncount(basis) for basis in bases] + [_count(basis, by_day) for basis in bases]
    if left_out:
        blocks.append(_TRIGGER_LEFT_OUT)
    return f"""
CREATE OR REPLACE FUNCTION sustain_probe_result_summary() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
  g text;
  gv text;
  fresh boolean;
  latest timestamp with time zone;
  why text;
BEGIN{"".join(blocks)}
  RETURN NULL;
END
$$
"""


CREATE_TRIGGER = (
    "CREATE TRIGGER probe_result_summary AFTER INSERT OR UPDATE OR DELETE ON probe_runs "
    "FOR EACH ROW EXECUTE FUNCTION sustain_probe_result_summary()"
)


def _create_rank_index(basis: str, grouping: str) -> str:
    """A group's results by bucket, then by when they ended (migration 0014), with their value:
    one bucket's results, or those of a period, are a range of it, read without the table."""
    column, value = GROUPINGS[grouping], VALUES[basis]
    return (
        f"CREATE INDEX {RANK_INDEXES[basis, grouping]} ON probe_runs "
        f"({', '.join(GROUP_KEYS)}, {column}, sustain_result_bucket({value}), ended_at) "
        f"INCLUDE ({value}) WHERE {WHERES[basis]}"
    )


def remake_rank_indexes(connection: Connection) -> None:
    """Migration 0014: the rank indexes of the bases that exist, in ``_create_rank_index``'s
    order, where they are not (migration 0010 and 0011 make them so since 0014 exists)."""
    definition = text("SELECT pg_get_indexdef(to_regclass(:name))")
    for basis in present(connection)[0]:
        for grouping in GROUPINGS:
            name = RANK_INDEXES[basis, grouping]
            made = connection.execute(definition, {"name": name}).scalar()
            if made is not None and f"INCLUDE ({VALUES[basis]})" in made:
                continue
            connection.exec_driver_sql(f"DROP INDEX IF EXISTS {name}")
            connection.exec_driver_sql(_create_rank_index(basis, grouping))


def _results(basis: str, columns: str, where: str) -> str:
    """Each result of ``basis`` once per grouping: ``grouping``, ``gv``, the probe keys and
    ``columns``."""
    keys = ", ".join(f"coalesce(r.{name}, '') AS {name}" for name in PROBE_KEYS)
    return " UNION ALL ".join(
        f"SELECT '{grouping}' AS grouping, {value} AS gv, {keys}, {columns} "
        f"FROM probe_runs r WHERE {_on(WHERES[basis], 'r')} AND r.ended_at IS NOT NULL {where}"
        for grouping, value in _GROUP_OF.items()
    )


def _fill_days(basis: str, where: str = "") -> str:
    selects = _results(
        basis, f"{_day('r')} AS day, sustain_result_bucket(r.{VALUES[basis]}) AS bucket", where
    )
    return (
        f"INSERT INTO {table_of(basis, 'days')} ({_COLUMNS_DAYS}) "
        f"SELECT day, grouping, gv, {_KEYS}, bucket, count(*) FROM ({selects}) s "
        f"GROUP BY day, grouping, gv, {_KEYS}, bucket"
    )


def _fill_devices(basis: str, where: str = "") -> str:
    selects = _results(
        basis, "r.node, r.device, coalesce(r.device_model, '') AS device_model, r.ended_at", where
    )
    return (
        f"INSERT INTO {table_of(basis, 'devices')} ({_COLUMNS_DEVICES}) "
        f"SELECT grouping, gv, {_KEYS}, node, device, device_model, max(ended_at) "
        f"FROM ({selects}) s GROUP BY grouping, gv, {_KEYS}, node, device, device_model "
        # (a device seen later as well is already there, with its later result)
        "ON CONFLICT DO NOTHING"
    )


def _fill_buckets(basis: str) -> str:
    return (
        f"INSERT INTO {table_of(basis, 'buckets')} ({_COLUMNS_BUCKETS}) "
        f"SELECT grouping, group_value, {_KEYS}, bucket, sum(results) "
        f"FROM {table_of(basis, 'days')} GROUP BY grouping, group_value, {_KEYS}, bucket"
    )


def _fill_groups(basis: str) -> str:
    return (
        f"INSERT INTO {table_of(basis, 'groups')} ({_COLUMNS_GROUPS}) "
        f"SELECT grouping, group_value, {_KEYS}, count(*), min(device_model), max(device_model) "
        f"FROM {table_of(basis, 'devices')} GROUP BY grouping, group_value, {_KEYS}"
    )


def _fill_by_day(basis: str) -> str:
    return (
        f"INSERT INTO {table_of(basis, BY_DAY)} ({_COLUMNS_BY_DAY}) "
        f"SELECT grouping, group_value, {_KEYS}, {_date('last_ended_at')}, device_model, "
        f"count(*) FROM {table_of(basis, 'devices')} "
        f"GROUP BY grouping, group_value, {_KEYS}, {_date('last_ended_at')}, device_model"
    )


def _fill_left_out(where: str = "") -> str:
    keys = ", ".join(f"coalesce(r.{name}, '') AS {name}" for name in PROBE_KEYS)
    return (
        f"INSERT INTO {LEFT_OUT_TABLE} ({_COLUMNS_LEFT_OUT}) "
        f"SELECT day, {_KEYS}, reason, count(*) FROM (SELECT {_left_out_day('r')} AS day, "
        f"{keys}, {_reason('r')} AS reason FROM probe_runs r "
        f"WHERE {_on(LEFT_OUT_SQL, 'r')} {where}) s GROUP BY day, {_KEYS}, reason"
    )


def exists(connection: Connection, name: str) -> bool:
    """Whether the relation ``name`` exists (PostgreSQL): the parts a migration made."""
    found = connection.execute(text("SELECT to_regclass(:name)"), {"name": name}).scalar()
    return found is not None


def present(connection: Connection) -> tuple[list[str], bool, bool]:
    """The bases whose tables exist, whether the runs left out are counted, and whether the
    devices by day are kept (for every basis that exists)."""
    bases = [basis for basis in BASES if exists(connection, table_of(basis, "days"))]
    left_out = exists(connection, LEFT_OUT_TABLE)
    by_day = bool(bases) and all(exists(connection, table_of(basis, BY_DAY)) for basis in bases)
    return bases, left_out, by_day


def _keep(connection: Connection) -> None:
    """The trigger over the parts that exist (none left: no trigger, no functions)."""
    bases, left_out, by_day = present(connection)
    connection.exec_driver_sql("DROP TRIGGER IF EXISTS probe_result_summary ON probe_runs")
    if bases or left_out:
        connection.exec_driver_sql(trigger_function(bases, left_out, by_day))
        connection.exec_driver_sql(CREATE_TRIGGER)
        return
    connection.exec_driver_sql("DROP FUNCTION IF EXISTS sustain_probe_result_summary()")
    connection.exec_driver_sql("DROP FUNCTION IF EXISTS sustain_result_bucket(double precision)")


def create(connection: Connection, bases: Sequence[str] = BASES, *, left_out: bool = True) -> None:
    """The tables and rank indexes of ``bases`` (and of the runs left out), filled from the runs,
    and the trigger, which then keeps every part that exists."""
    connection.exec_driver_sql(BUCKET_FUNCTION)
    for basis in bases:
        for statement in _create_tables(basis):
            connection.exec_driver_sql(statement)
        for grouping in GROUPINGS:
            connection.exec_driver_sql(_create_rank_index(basis, grouping))
    if left_out:
        for statement in CREATE_LEFT_OUT:
            connection.exec_driver_sql(statement)
    _keep(connection)
    rebuild(connection, bases, left_out=left_out)


def drop(connection: Connection, bases: Sequence[str] = BASES, *, left_out: bool = True) -> None:
    """The parts named (all of them by default), and the trigger if nothing is left to keep."""
    for basis in bases:
        for grouping in GROUPINGS:
            connection.exec_driver_sql(f"DROP INDEX IF EXISTS {RANK_INDEXES[basis, grouping]}")
        for kind in KINDS:
            connection.exec_driver_sql(f"DROP TABLE IF EXISTS {table_of(basis, kind)}")
        connection.exec_driver_sql(f"DROP TABLE IF EXISTS {table_of(basis, BY_DAY)}")
    if left_out:
        connection.exec_driver_sql(f"DROP TABLE IF EXISTS {LEFT_OUT_TABLE}")
    _keep(connection)


def create_by_day(connection: Connection) -> None:
    """Migration 0013: the devices by day of every basis, filled from the devices tables, the
    trigger keeping them, and the period indexes."""
    bases, _, _ = present(connection)
    for basis in bases:
        connection.exec_driver_sql(_create_by_day(basis))
        connection.exec_driver_sql(_fill_by_day(basis))
    for statement in PERIOD_INDEXES.values():
        connection.exec_driver_sql(statement)
    _keep(connection)


def drop_by_day(connection: Connection) -> None:
    """Undo ``create_by_day``."""
    for name in PERIOD_INDEXES:
        connection.exec_driver_sql(f"DROP INDEX IF EXISTS {name}")
    for basis in BASES:
        connection.exec_driver_sql(f"DROP TABLE IF EXISTS {table_of(basis, BY_DAY)}")
    _keep(connection)


def rebuild(connection: Connection, bases: Sequence[str] = BASES, *, left_out: bool = True) -> None:
    """Recompute the tables of ``bases`` (and of the runs left out) from ``probe_runs``: after a
    bulk load made with triggers off, or when they are made."""
    by_day = present(connection)[2]
    tables = [table_of(basis, kind) for basis in bases for kind in KINDS]
    if by_day:
        tables += [table_of(basis, BY_DAY) for basis in bases]
    if left_out:
        tables.append(LEFT_OUT_TABLE)
    connection.exec_driver_sql(f"TRUNCATE {', '.join(tables)}")
    for basis in bases:
        connection.exec_driver_sql(_fill_days(basis))
        connection.exec_driver_sql(_fill_buckets(basis))
        connection.exec_driver_sql(_fill_devices(basis))
        connection.exec_driver_sql(_fill_groups(basis))
        if by_day:
            connection.exec_driver_sql(_fill_by_day(basis))
    if left_out:
        connection.exec_driver_sql(_fill_left_out())


def trim(connection: Connection, before: datetime) -> None:
    """Forget what retention dropped: ``before`` is the start of the oldest month kept.

    A run is in the partition of its start and in the summary's day of its end, so a run that
    started before ``before`` and ended on its first day is gone from the results but counted on
    that day: the first day kept, and the devices last seen on it, are counted again from the
    results left; the whole history's counts and the groups' devices follow from the rest.
    Ranges on indexed columns of the small summary tables, never of the results.
    """
    window = "AND r.ended_at >= :start AND r.ended_at < :end"
    bounds = {"start": before, "end": before + timedelta(days=1)}
    by_day = present(connection)[2]
    for basis in BASES:
        days, devices = table_of(basis, "days"), table_of(basis, "devices")
        connection.execute(text(f"DELETE FROM {days} WHERE day <= :day"), {"day": before.date()})
        connection.execute(text(_fill_days(basis, window)), bounds)
        connection.execute(
            text(f"DELETE FROM {devices} WHERE last_ended_at < :end"), {"end": bounds["end"]}
        )
        connection.execute(text(_fill_devices(basis, window)), bounds)
        connection.exec_driver_sql(
            f"TRUNCATE {table_of(basis, 'buckets')}, {table_of(basis, 'groups')}"
        )
        connection.exec_driver_sql(_fill_buckets(basis))
        connection.exec_driver_sql(_fill_groups(basis))
        if by_day:
            connection.exec_driver_sql(f"TRUNCATE {table_of(basis, BY_DAY)}")
            connection.exec_driver_sql(_fill_by_day(basis))
    connection.execute(
        text(f"DELETE FROM {LEFT_OUT_TABLE} WHERE day <= :day"), {"day": before.date()}
    )
    ended = "coalesce(r.ended_at, r.started_at)"
    connection.execute(text(_fill_left_out(f"AND {ended} >= :start AND {ended} < :end")), bounds)


_GROUP_KEY_LIST = ", ".join(GROUP_KEYS)


def _bucket(basis: str) -> str:
    return f"sustain_result_bucket({VALUES[basis]})"


def counts_query(by: str, basis: str, filters: list[str], *, since: bool) -> TextClause:
    """Results of ``basis`` per group and bucket of ``grouping`` ``by``: rows of
    (GROUP_KEYS..., group, bucket, results). Parameters: ``grouping``, each filter by name; with
    ``since``: ``since``, ``first_day`` (its date) and ``next_day`` (the day after, an instant):
    the days after ``first_day`` from the summary, the rest from the results. Without: the whole
    history's."""
    where = "".join(f" AND {name} = :{name}" for name in filters)
    if not since:
        return text(
            f"SELECT {_GROUP_KEY_LIST}, group_value, bucket, results "
            f"FROM {table_of(basis, 'buckets')} "
            f"WHERE grouping = :grouping{where} AND results > 0"
        )
    column = GROUPINGS[by]
    return text(
        f"SELECT {_GROUP_KEY_LIST}, group_value, bucket, sum(results) "
        f"FROM {table_of(basis, 'days')} WHERE grouping = :grouping{where} AND day > :first_day "
        f"GROUP BY {_GROUP_KEY_LIST}, group_value, bucket UNION ALL "
        f"SELECT {_GROUP_KEY_LIST}, coalesce({column}, ''), {_bucket(basis)}, count(*) "
        f"FROM probe_runs WHERE {WHERES[basis]}{where} "
        f"AND ended_at >= :since AND ended_at < :next_day "
        f"GROUP BY {_GROUP_KEY_LIST}, {column}, {_bucket(basis)}"
    )


def devices_query(basis: str, filters: list[str], *, since: bool) -> TextClause:
    """Devices of ``basis`` per group, and the least and greatest model among them: rows of
    (GROUP_KEYS..., group, devices, min model, max model)."""
    where = "".join(f" AND {name} = :{name}" for name in filters)
    if not since:
        return text(
            f"SELECT {_GROUP_KEY_LIST}, group_value, devices, low_model, high_model "
            f"FROM {table_of(basis, 'groups')} WHERE grouping = :grouping{where}"
        )
    # The devices whose latest result ended after ``since``'s day, by day; those of its own day
    # from the devices table by ``last_ended_at``.
    return text(
        f"SELECT {_GROUP_KEY_LIST}, group_value, sum(devices), min(device_model), "
        f"max(device_model) FROM (SELECT {_GROUP_KEY_LIST}, group_value, device_model, devices "
        f"FROM {table_of(basis, BY_DAY)} WHERE grouping = :grouping{where} "
        f"AND day > :first_day AND devices > 0 UNION ALL "
        f"SELECT {_GROUP_KEY_LIST}, group_value, device_model, 1 "
        f"FROM {table_of(basis, 'devices')} WHERE grouping = :grouping{where} "
        f"AND last_ended_at >= :since AND last_ended_at < :next_day) s "
        f"GROUP BY {_GROUP_KEY_LIST}, group_value"
    )


def left_out_query(filters: list[str], *, since: bool) -> TextClause:
    """The runs left out, per reason: rows of (reason, runs), a reason possibly twice (add
    them). Parameters: each filter by name; with ``since`` as for ``counts_query``."""
    where = "".join(f" AND {name} = :{name}" for name in filters)
    if not since:
        return text(
            f"SELECT reason, sum(runs) FROM {LEFT_OUT_TABLE} WHERE runs <> 0{where} GROUP BY reason"
        )
    ended = "coalesce(r.ended_at, r.started_at)"
    runs_where = "".join(f" AND r.{name} = :{name}" for name in filters)
    return text(
        f"SELECT reason, sum(runs) FROM {LEFT_OUT_TABLE} WHERE day > :first_day{where} "
        f"GROUP BY reason UNION ALL "
        f"SELECT {_reason('r')}, count(*) FROM probe_runs r WHERE {_on(LEFT_OUT_SQL, 'r')}"
        f"{runs_where} AND {ended} >= :since AND {ended} < :next_day GROUP BY 1"
    )


def rank_query(by: str, basis: str, nulls: list[bool], lookups: int, *, since: bool) -> TextClause:
    """For ``lookups`` reads of one shape at once, results of ``basis`` in value order within
    one bucket of a group, from an offset: rows of (lookup, value).

    Lookup ``j`` binds ``j_i`` (its number), ``j_b`` (the bucket), ``j_o`` (the offset), ``j_n``
    (how many values) and ``j_k0``, ``j_k1``, ... (GROUP_KEYS' values and ``by``'s) except where
    ``nulls`` says the value is NULL (an index serves ``IS NULL``, never ``IS NOT DISTINCT
    FROM``: groups with a NULL in another place are another shape). With ``since``: the results
    that ended at or after it. One statement, planned once, for every read of the shape; each
    reads the bucket's range of the basis's ``ix_probe_runs_rank_..._by_<by>`` (the period's
    part of it, with ``since``) and sorts it.
    """
    names = [*GROUP_KEYS, GROUPINGS[by]]
    given = [i for i, null in enumerate(nulls) if not null]
    rows = ", ".join(
        "("
        + ", ".join(
            [f"CAST(:l{j}_{name} AS integer)" for name in "ibn"]
            + [f"CAST(:l{j}_o AS bigint)"]
            + [f"CAST(:l{j}_k{i} AS text)" for i in given]
        )
        + ")"
        for j in range(lookups)
    )
    columns = ", ".join(["i", "b", "n", "o", *(f"k{i}" for i in given)])
    conditions = [
        f"{name} IS NULL" if null else f"{name} = w.k{i}"
        for i, (name, null) in enumerate(zip(names, nulls, strict=True))
    ]
    if since:
        conditions.append("ended_at >= :since")
    value, bucket = VALUES[basis], _bucket(basis)
    return text(
        f"SELECT w.i, r.{value} FROM (VALUES {rows}) AS w ({columns}) "
        f"CROSS JOIN LATERAL (SELECT {value} FROM probe_runs WHERE {WHERES[basis]} "
        f"AND {' AND '.join(conditions)} AND {bucket} = w.b "
        f"ORDER BY {value} OFFSET w.o LIMIT w.n) AS r"
    )
