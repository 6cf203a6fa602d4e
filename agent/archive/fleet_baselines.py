"""The fleet's baselines on PostgreSQL: computed once a period for the whole fleet, read by key.

Two readers on every node compare a device with its identical peers across the fleet: the drift
child's fleet outliers (each device's median of its last ``RECENT`` solo results against the
median of the other devices of the same model, stack and probe) and the health rule
``below_fleet_baseline`` (a device's results against the median of the other devices' latest
result of the same probe, size, model and stack). Read from the peers' rows, each costs the
whole fleet's results, on every node: 155 s of the server at 10 million results for the drift
child alone, 10,000 times an hour at 10,000 nodes.

Instead one agent at a time (whoever takes the advisory lock ``LOCK_KEY`` when the last pass is
older than its drift interval; the others find it fresh) computes every group's values in one
pass over the results and writes, per group, only what any member needs for its median of the
*others*: how many values there are and the (at most) three around the median (``Middle``).
Without one member, the median of a sorted list moves by at most one place, so those three give
it exactly, whichever member is left out. A node then reads a row per group of its own devices
(the primary key) and its own results (its node's index range): nothing it reads grows with the
fleet.

What a node knows of its own place in a group is what the pass saw: its own results that ended
by the pass's ``cutoff`` (and, for health, from its ``since``) and were written before it (a
row id up to the pass's ``last_id``: the pass reads one snapshot, REPEATABLE READ), recomputed
from its own rows. Only a run whose end is committed while the pass reads can fall between the
two; the median left out is then the nearest value, and the next pass agrees again.

PostgreSQL only, outside the models as the capacity summary is (agent.archive.summary): a SQLite
archive is one node's, its own fleet, read as before (agent.health.records, agent.drift.detect).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, text

from agent.archive import summary

TABLE = "fleet_baselines"
LOCK_KEY = 0x7375737461696E42  # the bytes of "sustainB": one pass at a time, fleet-wide
STATEMENT_BOUND = "10min"
"""The bound on each of the pass's statements (agent.archive.database's 60 s is for the agent's
writes and lookups)."""
RECENT = 5
"""A device's value in the outlier comparison: the median of its last RECENT solo results."""

OUTLIER, HEALTH = "outlier", "health"
GROUP_KEYS = ("workload", "precision", "optimization", "size", "device_model", "stack_id")

CREATE = (
    f"""
CREATE TABLE {TABLE} (
  kind text NOT NULL, workload text NOT NULL, precision text NOT NULL,
  optimization text NOT NULL, size text NOT NULL, device_model text NOT NULL,
  stack_id text NOT NULL,
  members integer NOT NULL,
  steady_count integer NOT NULL, steady_first integer NOT NULL, steady_middle text NOT NULL,
  ratio_count integer NOT NULL, ratio_first integer NOT NULL, ratio_middle text NOT NULL,
  since timestamp with time zone, cutoff timestamp with time zone NOT NULL,
  last_id bigint NOT NULL,
  CONSTRAINT pk_{TABLE} PRIMARY KEY
    (kind, workload, precision, optimization, size, device_model, stack_id)
)
""",
)
DROP = (f"DROP TABLE IF EXISTS {TABLE}",)

_SOLO_RESULTS = (
    "outcome = 'ok' AND steady_throughput IS NOT NULL AND ended_at IS NOT NULL AND scope = 'device'"
)
SERIES_INDEX = "ix_probe_runs_series_latest"
CREATE_SERIES_INDEX = (
    f"CREATE INDEX {SERIES_INDEX} ON probe_runs "
    "(node, device, workload, precision, optimization, ended_at DESC, id DESC) "
    f"INCLUDE (steady_throughput, device_model, stack_id) WHERE {_SOLO_RESULTS}"
)
"""The solo results in the outlier pass's order, with what it reads (migration 0013): the pass
streams them from the index (an index-only scan of each partition, merged) where it sorted the
whole fleet's results (6 s at a million, past its 60-s budget at 10 million)."""


@dataclass(frozen=True, slots=True)
class Middle:
    """The values around the median of a sorted list of ``count`` values: ``values`` are its
    items from index ``first`` on (three at most). Enough for the median of the list, and for
    the median of the list without any one of its items."""

    count: int
    first: int
    values: tuple[float, ...]

    @classmethod
    def of(cls, ordered: Sequence[float]) -> Middle:
        count = len(ordered)
        first = max(0, count // 2 - 1)
        return cls(count, first, tuple(float(v) for v in ordered[first : count // 2 + 2]))

    def _at(self, index: int) -> float:
        return self.values[index - self.first]

    def median(self, without: float | None = None) -> float | None:
        """The median (as statistics.median), of all the values or of all but one item equal
        (or, a value the pass did not see, nearest) to ``without``; None for none."""
        if without is None:
            count = self.count
            if count == 0:
                return None
            if count % 2:
                return self._at(count // 2)
            return (self._at(count // 2 - 1) + self._at(count // 2)) / 2
        count = self.count - 1
        if count <= 0:
            return None
        gone = self._position(without)

        def kept(index: int) -> float:  # the index-th of the list without item ``gone``
            return self._at(index) if index < gone else self._at(index + 1)

        if count % 2:
            return kept(count // 2)
        return (kept(count // 2 - 1) + kept(count // 2)) / 2

    def _position(self, value: float) -> int:
        """The index in the whole list of the item that ``value`` is: below or above the kept
        values where it lies beyond them, else the nearest of them (the first of equals)."""
        last = self.first + len(self.values)
        if value < self.values[0] and self.first > 0:
            return self.first - 1
        if value > self.values[-1] and last < self.count:
            return last
        nearest = min(range(len(self.values)), key=lambda i: (abs(self.values[i] - value), i))
        return self.first + nearest

    def as_row(self, prefix: str) -> dict[str, Any]:
        return {
            f"{prefix}_count": self.count,
            f"{prefix}_first": self.first,
            f"{prefix}_middle": json.dumps(self.values),
        }

    @classmethod
    def from_row(cls, row: Any, prefix: str) -> Middle:
        values = json.loads(getattr(row, f"{prefix}_middle"))
        return cls(getattr(row, f"{prefix}_count"), getattr(row, f"{prefix}_first"), tuple(values))


@dataclass(frozen=True, slots=True)
class Group:
    """One group's row: its members (devices) at the pass, and the middles of their values."""

    members: int
    steady: Middle
    ratio: Middle
    since: datetime | None
    cutoff: datetime
    last_id: int  # the greatest row id of probe_runs the pass saw

    def saw(self, ended_at: datetime, row_id: int) -> bool:
        """Whether the pass counted a result that ended then, with that row id."""
        return ended_at <= self.cutoff and row_id <= self.last_id


GroupKey = tuple[str, str, str, str, str, str]  # GROUP_KEYS' values ('' for none)

# The outlier pass: each series' last RECENT solo results up to the cutoff; its group is that of
# its latest one (model and stack), its value their median as statistics.median takes it.
_OUTLIER_SQL = f"""
WITH ranked AS (
  SELECT node, device, workload, precision, optimization, device_model, stack_id,
         steady_throughput AS value,
         row_number() OVER (PARTITION BY node, device, workload, precision, optimization
                            ORDER BY ended_at DESC, id DESC) AS rank
  FROM probe_runs
  WHERE {_SOLO_RESULTS} AND ended_at <= :cutoff
), series AS (
  SELECT workload, precision, optimization,
         (array_agg(coalesce(device_model, '') ORDER BY rank))[1] AS device_model,
         (array_agg(coalesce(stack_id, '') ORDER BY rank))[1] AS stack_id,
         array_agg(value ORDER BY value) AS recent, count(*) AS n
  FROM ranked WHERE rank <= {RECENT}
  GROUP BY node, device, workload, precision, optimization
)
SELECT workload, precision, optimization, '' AS size, device_model, stack_id,
       array_agg(CASE WHEN n % 2 = 1 THEN recent[n / 2 + 1]
                      ELSE (recent[n / 2] + recent[n / 2 + 1]) / 2 END) AS steady,
       NULL AS ratios
FROM series GROUP BY workload, precision, optimization, device_model, stack_id
"""

# The health pass: each device's latest ok solo result of each probe, size, model and stack
# that ended in [since, cutoff].
_HEALTH_SQL = """
WITH latest AS (
  SELECT DISTINCT ON (node, device, workload, precision, optimization,
                      coalesce(size, 'default'), device_model, stack_id)
         workload, precision, optimization, coalesce(size, 'default') AS size, device_model,
         stack_id, steady_throughput, sustained_ratio
  FROM probe_runs
  WHERE outcome = 'ok' AND scope = 'device' AND steady_throughput IS NOT NULL
    AND device_model IS NOT NULL AND stack_id IS NOT NULL
    AND ended_at >= :since AND ended_at <= :cutoff
  ORDER BY node, device, workload, precision, optimization, coalesce(size, 'default'),
           device_model, stack_id, ended_at DESC, id DESC
)
SELECT workload, precision, optimization, size, device_model, stack_id,
       array_agg(steady_throughput ORDER BY steady_throughput) AS steady,
       array_agg(sustained_ratio ORDER BY sustained_ratio)
         FILTER (WHERE sustained_ratio IS NOT NULL) AS ratios
FROM latest GROUP BY workload, precision, optimization, size, device_model, stack_id
"""


def _ordered(values: Iterable[float | None] | None) -> list[float]:
    return sorted(float(v) for v in values or () if v is not None)


def refresh(connection: Connection, *, cutoff: datetime, since: datetime) -> int:
    """Recompute every group's row from the results (in the caller's transaction, which readers
    see whole at its commit; REPEATABLE READ, so that what it reads is one snapshot); the number
    of rows written."""
    connection.exec_driver_sql("SET LOCAL work_mem = '256MB'")  # the window's sort in memory
    # The pass reads every result once: longer than the agent's statement timeout at fleet scale.
    connection.exec_driver_sql(f"SET LOCAL statement_timeout = '{STATEMENT_BOUND}'")
    last_id = connection.execute(text("SELECT coalesce(max(id), 0) FROM probe_runs")).scalar()
    rows: list[dict[str, Any]] = []
    for kind, sql in ((OUTLIER, _OUTLIER_SQL), (HEALTH, _HEALTH_SQL)):
        found = connection.execute(text(sql), {"cutoff": cutoff, "since": since})
        for row in found:
            steady = _ordered(row.steady)
            rows.append(
                dict(zip(GROUP_KEYS, row[:6], strict=True))
                | {"kind": kind, "members": len(steady), "since": since, "cutoff": cutoff}
                | {"last_id": last_id}
                | Middle.of(steady).as_row("steady")
                | Middle.of(_ordered(row.ratios)).as_row("ratio")
            )
    for kind_sql in (OUTLIER, HEALTH):
        connection.execute(text(f"DELETE FROM {TABLE} WHERE kind = :kind"), {"kind": kind_sql})
    if rows:
        columns = list(rows[0])
        connection.execute(
            text(
                f"INSERT INTO {TABLE} ({', '.join(columns)}) "
                f"VALUES ({', '.join(':' + c for c in columns)})"
            ),
            rows,
        )
    return len(rows)


def refresh_if_due(
    engine: Engine, *, now: datetime, interval_seconds: float, baseline_days: float
) -> bool:
    """The fleet's pass, where no agent has made one for ``interval_seconds`` and no other is
    making it now (the advisory lock): whether this call made it."""
    with (
        engine.connect().execution_options(isolation_level="REPEATABLE READ") as connection,
        connection.begin(),
    ):
        locked = connection.execute(
            text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": LOCK_KEY}
        ).scalar()
        if not locked:
            return False
        last = connection.execute(text(f"SELECT max(cutoff) FROM {TABLE}")).scalar()
        # A little early rather than a period late: agents' hourly children drift apart.
        if last is not None and now - last < timedelta(seconds=interval_seconds * 0.9):
            return False
        refresh(connection, cutoff=now, since=now - timedelta(days=baseline_days))
    return True


def groups(engine: Engine, kind: str, keys: Iterable[GroupKey]) -> dict[GroupKey, Group]:
    """The rows of ``kind`` for ``keys`` (a primary key lookup each)."""
    wanted = sorted(set(keys))
    found: dict[GroupKey, Group] = {}
    if not wanted:
        return found
    statement = text(
        f"SELECT * FROM {TABLE} WHERE kind = :kind AND workload = :workload "
        "AND precision = :precision AND optimization = :optimization AND size = :size "
        "AND device_model = :device_model AND stack_id = :stack_id"
    )
    with engine.connect() as connection:
        for key in wanted:
            row = connection.execute(
                statement, {"kind": kind, **dict(zip(GROUP_KEYS, key, strict=True))}
            ).first()
            if row is not None:
                found[key] = Group(
                    members=row.members,
                    steady=Middle.from_row(row, "steady"),
                    ratio=Middle.from_row(row, "ratio"),
                    since=row.since,
                    cutoff=row.cutoff,
                    last_id=row.last_id,
                )
    return found


def present(engine: Engine) -> bool:
    """Whether the archive has the fleet's baselines (PostgreSQL, migrated)."""
    if engine.dialect.name != "postgresql":
        return False
    with engine.connect() as connection:
        return summary.exists(connection, TABLE)
