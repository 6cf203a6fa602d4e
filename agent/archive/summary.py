"""The summary of probe results on PostgreSQL, kept by the database itself.

``sustain capacity`` over a fleet's whole history must not read every result: at 10,000 nodes the
archive holds tens of millions. Four tables, written by a trigger on ``probe_runs`` in the same
transaction as the run (so they can never disagree with it, whichever agent version wrote the
run), answer the counts and locate the quantiles:

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

From the counts alone the query finds the bucket that holds each quantile's rank, then reads the
exact value from the results of that one bucket through an index in (group, bucket, value)
order (``ix_probe_runs_rank_by_*``): the answer is the unsummarised query's, to the last bit.

They are PostgreSQL only (SQLite has no such fleet, and keeps its index-walking query), which is
why they are not among the models: migrations/env.py leaves them out of Alembic's comparison.
NULL keys are stored as '' so that the unique keys match them; no key is '' otherwise. A
deleted result (retention drops whole months, which ``trim`` follows) is uncounted, but its
device is not forgotten until ``trim``: the device counts are those of devices ever seen.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import Connection, TextClause, text

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

RANK_INDEXES = {
    "model": "ix_probe_runs_rank_by_model",
    "stack": "ix_probe_runs_rank_by_stack",
}
"""PostgreSQL-only indexes for reading a quantile's exact value within its bucket."""

TABLES = (
    "probe_result_days",
    "probe_result_buckets",
    "probe_result_devices",
    "probe_result_groups",
)

INDEXES = ("ix_probe_result_days_day", "ix_probe_result_devices_last_ended_at")

RESULTS_WHERE = "outcome = 'ok' AND steady_throughput IS NOT NULL"

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

CREATE_TABLES = (
    f"""
CREATE TABLE probe_result_days (
  day date NOT NULL, {_GROUP_COLUMNS}, {_KEY_COLUMNS},
  bucket integer NOT NULL, results bigint NOT NULL,
  CONSTRAINT pk_probe_result_days PRIMARY KEY (grouping, {_KEYS}, group_value, day, bucket)
)
""",
    "CREATE INDEX ix_probe_result_days_day ON probe_result_days (day)",
    f"""
CREATE TABLE probe_result_buckets (
  {_GROUP_COLUMNS}, {_KEY_COLUMNS}, bucket integer NOT NULL, results bigint NOT NULL,
  CONSTRAINT pk_probe_result_buckets PRIMARY KEY (grouping, {_KEYS}, group_value, bucket)
)
""",
    f"""
CREATE TABLE probe_result_devices (
  {_GROUP_COLUMNS}, {_KEY_COLUMNS},
  node varchar(255) NOT NULL, device varchar(128) NOT NULL, device_model varchar(128) NOT NULL,
  last_ended_at timestamp with time zone NOT NULL,
  CONSTRAINT pk_probe_result_devices PRIMARY KEY
    (grouping, {_KEYS}, group_value, node, device, device_model)
)
""",
    "CREATE INDEX ix_probe_result_devices_last_ended_at ON probe_result_devices (last_ended_at)",
    f"""
CREATE TABLE probe_result_groups (
  {_GROUP_COLUMNS}, {_KEY_COLUMNS}, devices bigint NOT NULL,
  low_model varchar(128) NOT NULL, high_model varchar(128) NOT NULL,
  CONSTRAINT pk_probe_result_groups PRIMARY KEY (grouping, {_KEYS}, group_value)
)
""",
)


def _keys(row: str) -> str:
    return ", ".join(f"coalesce({row}.{name}, '')" for name in PROBE_KEYS)


def _day(row: str) -> str:
    return f"({row}.ended_at AT TIME ZONE 'UTC')::date"


_GROUP_OF = {grouping: f"coalesce(r.{column}, '')" for grouping, column in GROUPINGS.items()}

_COLUMNS_DAYS = f"day, grouping, group_value, {_KEYS}, bucket, results"
_COLUMNS_BUCKETS = f"grouping, group_value, {_KEYS}, bucket, results"
_COLUMNS_DEVICES = f"grouping, group_value, {_KEYS}, node, device, device_model, last_ended_at"
_COLUMNS_GROUPS = f"grouping, group_value, {_KEYS}, devices, low_model, high_model"
_DAYS_KEY = f"grouping, {_KEYS}, group_value, day, bucket"
_BUCKETS_KEY = f"grouping, {_KEYS}, group_value, bucket"
_DEVICES_KEY = f"grouping, {_KEYS}, group_value, node, device, device_model"
_GROUPS_KEY = f"grouping, {_KEYS}, group_value"

# In the trigger: ``g`` is the grouping, ``gv`` its value for the row at hand (OLD or NEW).
_MATCH = " AND ".join(
    [
        "grouping = g",
        "group_value = gv",
        *(f"{name} = coalesce({{row}}.{name}, '')" for name in PROBE_KEYS),
        "bucket = sustain_result_bucket({row}.steady_throughput)",
    ]
)


def _group_value(row: str) -> str:
    return (
        f"CASE g WHEN 'model' THEN coalesce({row}.device_model, '') "
        f"ELSE coalesce({row}.stack_id, '') END"
    )


TRIGGER_FUNCTION = f"""
CREATE OR REPLACE FUNCTION sustain_probe_result_summary() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
  g text;
  gv text;
  fresh boolean;
BEGIN
  -- A result that was counted and is changed or removed is uncounted first (a replayed
  -- finish rewrites the same values: uncounted, then counted again).
  IF TG_OP IN ('UPDATE', 'DELETE') AND OLD.outcome = 'ok'
     AND OLD.steady_throughput IS NOT NULL AND OLD.ended_at IS NOT NULL THEN
    FOREACH g IN ARRAY ARRAY['model', 'stack'] LOOP
      gv := {_group_value("OLD")};
      UPDATE probe_result_days SET results = results - 1
        WHERE day = {_day("OLD")} AND {_MATCH.format(row="OLD")};
      UPDATE probe_result_buckets SET results = results - 1 WHERE {_MATCH.format(row="OLD")};
    END LOOP;
  END IF;
  IF TG_OP IN ('INSERT', 'UPDATE') AND NEW.outcome = 'ok'
     AND NEW.steady_throughput IS NOT NULL AND NEW.ended_at IS NOT NULL THEN
    FOREACH g IN ARRAY ARRAY['model', 'stack'] LOOP
      gv := {_group_value("NEW")};
      INSERT INTO probe_result_days ({_COLUMNS_DAYS})
        VALUES ({_day("NEW")}, g, gv, {_keys("NEW")},
                sustain_result_bucket(NEW.steady_throughput), 1)
        ON CONFLICT ({_DAYS_KEY}) DO UPDATE SET results = probe_result_days.results + 1;
      INSERT INTO probe_result_buckets ({_COLUMNS_BUCKETS})
        VALUES (g, gv, {_keys("NEW")}, sustain_result_bucket(NEW.steady_throughput), 1)
        ON CONFLICT ({_BUCKETS_KEY}) DO UPDATE SET results = probe_result_buckets.results + 1;
      INSERT INTO probe_result_devices ({_COLUMNS_DEVICES})
        VALUES (g, gv, {_keys("NEW")}, NEW.node, NEW.device, coalesce(NEW.device_model, ''),
                NEW.ended_at)
        ON CONFLICT ({_DEVICES_KEY}) DO UPDATE
          SET last_ended_at = greatest(probe_result_devices.last_ended_at, EXCLUDED.last_ended_at)
        RETURNING (xmax = 0) INTO fresh;
      IF fresh THEN  -- a device new to the group
        INSERT INTO probe_result_groups ({_COLUMNS_GROUPS})
          VALUES (g, gv, {_keys("NEW")}, 1, coalesce(NEW.device_model, ''),
                  coalesce(NEW.device_model, ''))
          ON CONFLICT ({_GROUPS_KEY}) DO UPDATE SET
            devices = probe_result_groups.devices + 1,
            low_model = least(probe_result_groups.low_model, EXCLUDED.low_model),
            high_model = greatest(probe_result_groups.high_model, EXCLUDED.high_model);
      END IF;
    END LOOP;
  END IF;
  RETURN NULL;
END
$$
"""

CREATE_TRIGGER = (
    "CREATE TRIGGER probe_result_summary AFTER INSERT OR UPDATE OR DELETE ON probe_runs "
    "FOR EACH ROW EXECUTE FUNCTION sustain_probe_result_summary()"
)


def _rank_index(grouping: str) -> str:
    column = GROUPINGS[grouping]
    return (
        f"CREATE INDEX {RANK_INDEXES[grouping]} ON probe_runs "
        f"({', '.join(GROUP_KEYS)}, {column}, "
        f"sustain_result_bucket(steady_throughput), steady_throughput, ended_at) "
        f"WHERE {RESULTS_WHERE}"
    )


_RESULTS = f"r.{RESULTS_WHERE.replace(' AND ', ' AND r.')} AND r.ended_at IS NOT NULL"


def _results(columns: str, where: str) -> str:
    """Each result once per grouping: ``grouping``, ``gv``, the probe keys and ``columns``."""
    keys = ", ".join(f"coalesce(r.{name}, '') AS {name}" for name in PROBE_KEYS)
    return " UNION ALL ".join(
        f"SELECT '{grouping}' AS grouping, {value} AS gv, {keys}, {columns} "
        f"FROM probe_runs r WHERE {_RESULTS} {where}"
        for grouping, value in _GROUP_OF.items()
    )


def _fill_days(where: str = "") -> str:
    selects = _results(
        f"{_day('r')} AS day, sustain_result_bucket(r.steady_throughput) AS bucket", where
    )
    return (
        f"INSERT INTO probe_result_days ({_COLUMNS_DAYS}) "
        f"SELECT day, grouping, gv, {_KEYS}, bucket, count(*) FROM ({selects}) s "
        f"GROUP BY day, grouping, gv, {_KEYS}, bucket"
    )


def _fill_devices(where: str = "") -> str:
    selects = _results(
        "r.node, r.device, coalesce(r.device_model, '') AS device_model, r.ended_at", where
    )
    return (
        f"INSERT INTO probe_result_devices ({_COLUMNS_DEVICES}) "
        f"SELECT grouping, gv, {_KEYS}, node, device, device_model, max(ended_at) "
        f"FROM ({selects}) s GROUP BY grouping, gv, {_KEYS}, node, device, device_model "
        # (a device seen later as well is already there, with its later result)
        "ON CONFLICT DO NOTHING"
    )


_FILL_BUCKETS = (
    f"INSERT INTO probe_result_buckets ({_COLUMNS_BUCKETS}) "
    f"SELECT grouping, group_value, {_KEYS}, bucket, sum(results) FROM probe_result_days "
    f"GROUP BY grouping, group_value, {_KEYS}, bucket"
)
_FILL_GROUPS = (
    f"INSERT INTO probe_result_groups ({_COLUMNS_GROUPS}) "
    f"SELECT grouping, group_value, {_KEYS}, count(*), min(device_model), max(device_model) "
    f"FROM probe_result_devices GROUP BY grouping, group_value, {_KEYS}"
)


def create(connection: Connection) -> None:
    """The bucket function, the tables, the trigger and the rank indexes; filled from the runs."""
    connection.exec_driver_sql(BUCKET_FUNCTION)
    for statement in CREATE_TABLES:
        connection.exec_driver_sql(statement)
    for grouping in GROUPINGS:
        connection.exec_driver_sql(_rank_index(grouping))
    connection.exec_driver_sql(TRIGGER_FUNCTION)
    connection.exec_driver_sql(CREATE_TRIGGER)
    rebuild(connection)


def drop(connection: Connection) -> None:
    connection.exec_driver_sql("DROP TRIGGER IF EXISTS probe_result_summary ON probe_runs")
    connection.exec_driver_sql("DROP FUNCTION IF EXISTS sustain_probe_result_summary()")
    for name in RANK_INDEXES.values():
        connection.exec_driver_sql(f"DROP INDEX IF EXISTS {name}")
    for table in TABLES:
        connection.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
    connection.exec_driver_sql("DROP FUNCTION IF EXISTS sustain_result_bucket(double precision)")


def rebuild(connection: Connection) -> None:
    """Recompute the tables from ``probe_runs`` (after a bulk load made with triggers off)."""
    connection.exec_driver_sql(f"TRUNCATE {', '.join(TABLES)}")
    connection.exec_driver_sql(_fill_days())
    connection.exec_driver_sql(_FILL_BUCKETS)
    connection.exec_driver_sql(_fill_devices())
    connection.exec_driver_sql(_FILL_GROUPS)


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
    connection.execute(
        text("DELETE FROM probe_result_days WHERE day <= :day"), {"day": before.date()}
    )
    connection.execute(text(_fill_days(window)), bounds)
    connection.execute(
        text("DELETE FROM probe_result_devices WHERE last_ended_at < :end"), {"end": bounds["end"]}
    )
    connection.execute(text(_fill_devices(window)), bounds)
    connection.exec_driver_sql("TRUNCATE probe_result_buckets, probe_result_groups")
    connection.exec_driver_sql(_FILL_BUCKETS)
    connection.exec_driver_sql(_FILL_GROUPS)


_GROUP_KEY_LIST = ", ".join(GROUP_KEYS)
_BUCKET = "sustain_result_bucket(steady_throughput)"


def counts_query(by: str, filters: list[str], *, since: bool) -> TextClause:
    """Results per group and bucket of ``grouping`` ``by``: rows of (GROUP_KEYS..., group,
    bucket, results). Parameters: ``grouping``, each filter by name; with ``since``: ``since``,
    ``first_day`` (its date) and ``next_day`` (the day after, an instant): the days after
    ``first_day`` from the summary, the rest from the results. Without: the whole history's."""
    where = "".join(f" AND {name} = :{name}" for name in filters)
    if not since:
        return text(
            f"SELECT {_GROUP_KEY_LIST}, group_value, bucket, results FROM probe_result_buckets "
            f"WHERE grouping = :grouping{where} AND results > 0"
        )
    column = GROUPINGS[by]
    return text(
        f"SELECT {_GROUP_KEY_LIST}, group_value, bucket, sum(results) FROM probe_result_days "
        f"WHERE grouping = :grouping{where} AND day > :first_day "
        f"GROUP BY {_GROUP_KEY_LIST}, group_value, bucket UNION ALL "
        f"SELECT {_GROUP_KEY_LIST}, coalesce({column}, ''), {_BUCKET}, count(*) FROM probe_runs "
        f"WHERE {RESULTS_WHERE}{where} AND ended_at >= :since AND ended_at < :next_day "
        f"GROUP BY {_GROUP_KEY_LIST}, {column}, {_BUCKET}"
    )


def devices_query(filters: list[str], *, since: bool) -> TextClause:
    """Devices per group, and the least and greatest model among them: rows of
    (GROUP_KEYS..., group, devices, min model, max model)."""
    where = "".join(f" AND {name} = :{name}" for name in filters)
    if not since:
        return text(
            f"SELECT {_GROUP_KEY_LIST}, group_value, devices, low_model, high_model "
            f"FROM probe_result_groups WHERE grouping = :grouping{where}"
        )
    return text(
        f"SELECT {_GROUP_KEY_LIST}, group_value, count(*), min(device_model), max(device_model) "
        f"FROM probe_result_devices WHERE grouping = :grouping{where} "
        f"AND last_ended_at >= :since GROUP BY {_GROUP_KEY_LIST}, group_value"
    )


def rank_query(by: str, nulls: list[bool], lookups: int, *, since: bool) -> TextClause:
    """For ``lookups`` groups of one shape at once, two results each in (bucket, value) order
    from an offset within the buckets from a bucket on: rows of (lookup, value).

    Lookup ``j`` binds ``j_i`` (its number), ``j_b`` (the bucket), ``j_o`` (the offset) and
    ``j_k0``, ``j_k1``, ... (GROUP_KEYS' values and ``by``'s) except where ``nulls`` says the
    value is NULL (an index serves ``IS NULL``, never ``IS NOT DISTINCT FROM``: groups with a
    NULL in another place are another shape). One statement, planned once, for every group
    of the shape; each lookup walks ``ix_probe_runs_rank_by_<by>`` from its bucket.
    """
    names = [*GROUP_KEYS, GROUPINGS[by]]
    given = [i for i, null in enumerate(nulls) if not null]
    rows = ", ".join(
        "("
        + ", ".join(
            [f"CAST(:l{j}_i AS integer)", f"CAST(:l{j}_b AS integer)", f"CAST(:l{j}_o AS bigint)"]
            + [f"CAST(:l{j}_k{i} AS text)" for i in given]
        )
        + ")"
        for j in range(lookups)
    )
    columns = ", ".join(["i", "b", "o", *(f"k{i}" for i in given)])
    conditions = [
        f"{name} IS NULL" if null else f"{name} = w.k{i}"
        for i, (name, null) in enumerate(zip(names, nulls, strict=True))
    ]
    if since:
        conditions.append("ended_at >= :since")
    return text(
        f"SELECT w.i, r.steady_throughput FROM (VALUES {rows}) AS w ({columns}) "
        f"CROSS JOIN LATERAL (SELECT steady_throughput FROM probe_runs WHERE {RESULTS_WHERE} "
        f"AND {' AND '.join(conditions)} AND {_BUCKET} >= w.b "
        f"ORDER BY {_BUCKET}, steady_throughput OFFSET w.o LIMIT 2) AS r"
    )
