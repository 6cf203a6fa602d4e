"""Sustained capacity for planners: ``sustain capacity``.

What a planner needs is the throughput a group of devices (a GPU model, a node, a software stack)
sustains, per workload and precision, and how far it is from the spec sheet: the median of the
steady-state figures of the analysed probe runs (the ``probe_results`` view), their 10th
percentile (what the slower part of the group gives: a synchronous job runs at the pace of its
slowest device), how many results and devices that rests on, and the median's ratio to the
model's published peak (``agent.reports.specs``). Runs of different problem sizes are never
mixed: a small problem runs below the device's sustained rate, so each size is a group of its own
(``RESULT_GROUP``, the columns every group starts with). Nor are solo and node-wide runs
(``scope``, since migration 0009): a device that sustains its rate alone may not when every
device of its node works, as production runs them, and the node-wide figure beside the solo one
is what a planner should plan with; the node's sum (``node_total``) is a group of its own too.

Every run counts (issue 23): the figure is what the runs delivered. An ok run the analysis found
never settled (``no_steady_state``) has no steady value, but its p10 over one-second windows says
what it delivered; it counts on that, its **basis** (``BASES``): ``steady`` or ``p10``. The two
are never mixed in one row (a mean of a steady regime is not a percentile of windows), so a group
with runs of both has a row of each. The runs that gave no figure are left out, and counted by
why (``LEFT_OUT_REASONS``; agent.archive.models says which runs are which): every answer says how
many runs it rests on, on which basis, and how many it leaves out (``RunsCounted``).

The percentiles are those of numpy's default and of PostgreSQL's ``percentile_cont``: linear
interpolation between the two nearest ranks. A fleet's archive holds millions of results, so no
query here reads them all into Python or sorts them all: the counts come from one row per device
and group (``_summaries``), PostgreSQL computes the percentiles with ``percentile_cont``, and
SQLite, which has no percentile function, reads the two values around each rank from an index in
value order (``_quantiles_by_rank``). The partial covering indexes ``ix_probe_runs_results_by_*``
and ``ix_probe_runs_p10_results_by_*`` (``agent.archive.models``) are what keep a query over a
million results near a second (``bench/capacity.py``); reading the values into Python and numpy,
one group at a time, took ten. The runs left out are counted from ``ix_probe_runs_left_out``,
which holds them alone.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeAlias

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    Float,
    String,
    TableClause,
    TextClause,
    bindparam,
    column,
    func,
    select,
    table,
)
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.sql.expression import UnaryExpression
from sqlalchemy.sql.operators import custom_op

from agent.archive import summary
from agent.archive.database import archive_error
from agent.archive.models import (
    LEFT_OUT_WHERE,
    P10_RESULTS_WHERE,
    RESULT_GROUP,
    RUN_FILTERS,
    UTCDateTime,
)
from agent.reports.specs import spec_peak

GROUPINGS = ("model", "node", "stack")

_COLUMNS = (
    column("node", String),
    column("device", String),
    column("device_model", String),
    column("stack_id", String),
    column("workload", String),
    column("precision", String),
    column("optimization", String),
    column("size", String),
    column("scope", String),
    column("unit", String),
    column("ended_at", UTCDateTime()),
)
# The view of migration 0005 (ok runs with a steady value), described for queries only: the
# models map tables, and a view must not be created by ``create_all`` or autogenerate.
probe_results = table("probe_results", *_COLUMNS, column("steady_throughput", Float))
# The runs themselves, for the p10 basis and the runs left out: a query names their rows with
# the condition of their partial indexes (agent.archive.models), so that both databases read
# the index and never the table.
probe_runs = table(
    "probe_runs",
    *(column(c.name, c.type) for c in _COLUMNS),
    column("p10_throughput", Float),
    column("outcome", String),
    column("classification", String),
    column("started_at", UTCDateTime()),
)
_GROUP_COLUMN = {"model": "device_model", "node": "node", "stack": "stack_id"}
# Columns of RESULT_GROUP that runs archived before they were recorded leave NULL.
_NULLABLE = frozenset({"unit", "size"})

SCOPES = ("device", "node", "node_total")
"""A run's scope (``probe_runs.scope``), in the order the rows of one group and size are shown:
solo, then each device within a node-wide run, then the node-wide run's sum over the node."""
SCOPE_SHOWN = {"device": "solo", "node": "node-wide", "node_total": "node-total"}

BASES = ("steady", "p10")
"""What a row's runs count on, in the order rows are shown: their steady value, or (runs with no
steady state) their p10 over one-second windows."""

LEFT_OUT_REASONS = ("failed", "timeout", "preempted", "aborted", "insufficient", "no_figure")
"""Why a run that could have given a figure gave none: its outcome, or for an ok run its
classification ``insufficient`` (too short to judge), else ``no_figure`` (not analysed, or too
short for three one-second windows)."""

STREAM_CHUNK = 20_000
"""Summary rows fetched at a time (through a server-side cursor on PostgreSQL)."""

QUANTILES = (0.5, 0.1)


@dataclass(frozen=True, slots=True)
class CapacityRow:
    """One group's sustained throughput for one (workload, precision, optimization, size, unit)
    and basis.

    ``group`` is the device model, node or stack id (None where the runs did not record it:
    runs archived before stacks and models were); ``size`` the problem size (None for runs
    archived without it); ``scope`` one of SCOPES (runs archived before node-wide runs are
    ``device``); ``basis`` one of BASES. ``median`` and ``p10`` are in ``unit``, over the runs'
    steady values or (basis ``p10``) their p10s. ``spec_ratio`` is ``median`` over the model's
    published peak; None where the peak is not known, the group mixes models (a node or a stack
    may span several) or the figures are a node's sum (the peak is a device's).
    """

    group: str | None
    workload: str
    precision: str
    optimization: str
    size: str | None
    scope: str
    basis: str
    unit: str | None
    median: float
    p10: float
    results: int
    devices: int
    spec_ratio: float | None


@dataclass(frozen=True, slots=True)
class RunsCounted:
    """The runs an answer rests on, by basis, and those it leaves out, by reason."""

    steady: int
    p10: int
    left_out: dict[str, int]
    """Every reason of LEFT_OUT_REASONS, in that order, with its runs (0 for none)."""

    @property
    def used(self) -> int:
        return self.steady + self.p10

    @property
    def left_out_total(self) -> int:
        return sum(self.left_out.values())

    def as_json(self) -> dict[str, Any]:
        return {"used": {"steady": self.steady, "p10": self.p10}, "left_out": dict(self.left_out)}


@dataclass(frozen=True, slots=True)
class Capacity:
    """The rows of an answer and the runs behind it, read in one transaction."""

    rows: list[CapacityRow]
    runs: RunsCounted


def left_out_reason(outcome: str, classification: str | None) -> str:
    """Why a run left out (a run of ``LEFT_OUT_WHERE``) gave no figure: one of
    LEFT_OUT_REASONS (agent.archive.summary says the same in SQL)."""
    if outcome != "ok":
        return outcome
    return "insufficient" if classification == "insufficient" else "no_figure"


def capacity(
    engine: Engine,
    *,
    by: str = "model",
    precision: str | None = None,
    workload: str | None = None,
    optimization: str | None = None,
    size: str | None = None,
    scope: str | None = None,
    since: datetime | None = None,
) -> list[CapacityRow]:
    """Sustained throughput per group, sorted by (workload, precision, optimization, unit,
    basis in the order of BASES, group, size, scope in the order of SCOPES): the rows of
    ``capacity_with_runs``, without counting the runs left out."""
    filters = {
        "precision": precision,
        "workload": workload,
        "optimization": optimization,
        "size": size,
        "scope": scope,
    }
    return _capacity(engine, by, filters, since, left_out=False).rows


def capacity_with_runs(
    engine: Engine,
    *,
    by: str = "model",
    precision: str | None = None,
    workload: str | None = None,
    optimization: str | None = None,
    size: str | None = None,
    scope: str | None = None,
    since: datetime | None = None,
) -> Capacity:
    """Sustained throughput per group (as ``capacity``), and the runs behind it: how many on
    each basis, and how many of the runs matching the same filters were left out, by reason.

    ``since`` keeps the runs that ended at or after it (an aware datetime; an aborted run, whose
    end was never recorded, by its start). Raises ValueError for an unknown ``by`` or ``scope``
    and ArchiveError when the database cannot be read.
    """
    filters = {
        "precision": precision,
        "workload": workload,
        "optimization": optimization,
        "size": size,
        "scope": scope,
    }
    return _capacity(engine, by, filters, since, left_out=True)


Condition: TypeAlias = ColumnElement[bool] | TextClause
"""A term of a WHERE clause: a comparison, or the condition of a partial index as its SQL."""


@dataclass(frozen=True, slots=True)
class _Source:
    """Where the results of one basis are: a relation with the group columns, the column of the
    figure, and the condition that names the basis's rows there (none for the view)."""

    basis: str
    relation: TableClause
    value: str
    where: tuple[Condition, ...]

    def column(self, name: str) -> ColumnElement[Any]:
        return self.relation.c[name]


SOURCES = {
    "steady": _Source("steady", probe_results, "steady_throughput", ()),
    "p10": _Source("p10", probe_runs, "p10_throughput", (P10_RESULTS_WHERE,)),
}


def _capacity(
    engine: Engine,
    by: str,
    filters: dict[str, str | None],
    since: datetime | None,
    *,
    left_out: bool,
) -> Capacity:
    """Per basis, two queries: one row per device (``_summaries``: results, devices, models),
    then the quantiles of each group; then the runs left out. All in one transaction, so that
    they count the same runs."""
    if by not in GROUPINGS:
        raise ValueError(f"cannot group by {by!r}: expected one of {', '.join(GROUPINGS)}")
    scope = filters.get("scope")
    if scope is not None and scope not in SCOPES:
        raise ValueError(f"no scope {scope!r}: expected one of {', '.join(SCOPES)}")
    if since is not None and since.tzinfo is None:
        raise ValueError(f"naive datetime {since.isoformat()} for since (expected UTC)")
    rows: list[CapacityRow] = []
    reasons = dict.fromkeys(LEFT_OUT_REASONS, 0)
    try:
        with engine.connect() as connection:
            postgresql = connection.dialect.name == "postgresql"
            if postgresql:
                # SQLite's transaction sees one snapshot; PostgreSQL's default, one per query.
                connection.execution_options(isolation_level="REPEATABLE READ")
            summarised = postgresql and _summarised(connection)
            for source in SOURCES.values():
                if summarised and by in summary.GROUPINGS:
                    groups, quantiles = _from_summary(connection, source, by, filters, since)
                else:
                    conditions = _conditions(source, filters, since, sqlite=not postgresql)
                    groups = _summaries(connection, source, by, conditions)
                    if postgresql:
                        quantiles = _quantiles_in_sql(connection, source, by, conditions)
                    else:
                        quantiles = _quantiles_by_rank(connection, source, by, since, groups)
                rows += [
                    _row(key, group, quantiles[key], source.basis)
                    for key, group in groups.items()
                    if key in quantiles
                ]
            if left_out:
                found = (
                    _left_out_from_summary(connection, filters, since)
                    if summarised
                    else _left_out_in_runs(connection, filters, since, sqlite=not postgresql)
                )
                for reason, runs in found:
                    reasons[reason] += runs
    except SQLAlchemyError as exc:
        raise archive_error("query", engine, exc) from exc
    rows.sort(key=_order)
    counted = RunsCounted(
        steady=sum(row.results for row in rows if row.basis == "steady"),
        p10=sum(row.results for row in rows if row.basis == "p10"),
        left_out=reasons,
    )
    return Capacity(rows, counted)


@dataclass(frozen=True, slots=True)
class ResultsOverview:
    """What the archive's results could have matched: for saying why a query found none."""

    newest: datetime | None
    """When the newest result (of either basis) ended; None where the archive has none."""
    known: dict[str, list[str]]
    """Each filter asked about, with its values among all the results, sorted."""


def overview(engine: Engine, filters: Iterable[str]) -> ResultsOverview:
    """The newest result's end, and the known values of ``filters`` (names in RUN_FILTERS), over the
    results of both bases.

    For a query that found nothing: each DISTINCT reads a whole index.
    """
    names = list(filters)
    if unknown := [name for name in names if name not in RUN_FILTERS]:
        raise ValueError(f"cannot list the values of {', '.join(unknown)}")
    ends: list[datetime] = []
    known: dict[str, set[str]] = {name: set() for name in names}
    try:
        with engine.connect() as connection:
            for source in SOURCES.values():
                ended = source.column("ended_at")
                newest = connection.execute(select(func.max(ended)).where(*source.where)).scalar()
                if newest is not None:
                    ends.append(newest)
                for name in names:
                    values = source.column(name)
                    query = select(values).where(*source.where, values.is_not(None)).distinct()
                    known[name].update(connection.execute(query).scalars())
    except SQLAlchemyError as exc:
        raise archive_error("query", engine, exc) from exc
    return ResultsOverview(max(ends, default=None), {n: sorted(v) for n, v in known.items()})


def _section(row: CapacityRow) -> tuple[object, ...]:
    """What one section of the table measured: a probe and the unit of its figures."""
    return (row.workload, row.precision, row.optimization, row.unit is None, row.unit or "")


def _order(row: CapacityRow) -> tuple[object, ...]:
    return (
        *_section(row),
        BASES.index(row.basis) if row.basis in BASES else len(BASES),
        row.group is None,
        row.group or "",
        row.size is None,
        row.size or "",
        SCOPES.index(row.scope) if row.scope in SCOPES else len(SCOPES),
        row.scope,
    )


def _unindexed(column: ColumnElement[Any]) -> ColumnElement[Any]:
    """``+column``: SQLite's documented way to keep a term from choosing the index.

    Without statistics (the agent never runs ANALYZE) SQLite's planner, given a filter on a
    column that no index starts with (``workload = 'matmul'``), picks the narrowest index and
    sorts a million rows; with the term disqualified it follows ``..._by_device`` as unfiltered
    queries do. Only ``precision``, which the indexes start with, is left to the planner.
    """
    return UnaryExpression(column, operator=custom_op("+"), type_=column.type)


def _filters(
    relation: TableClause, filters: dict[str, str | None], *, sqlite: bool
) -> list[ColumnElement[bool]]:
    conditions: list[ColumnElement[bool]] = []
    for name, value in filters.items():
        if value is not None:
            column = relation.c[name]
            conditions.append(
                (column if name == "precision" or not sqlite else _unindexed(column)) == value
            )
    return conditions


def _conditions(
    source: _Source, filters: dict[str, str | None], since: datetime | None, *, sqlite: bool
) -> list[Condition]:
    conditions: list[Condition] = [
        *source.where,
        *_filters(source.relation, filters, sqlite=sqlite),
    ]
    if since is not None:
        ended = source.column("ended_at")
        conditions.append((_unindexed(ended) if sqlite else ended) >= since)
    return conditions


# A group: the values of RESULT_GROUP (the order of the indexes), then the model, node or stack.
Key = tuple[Any, ...]


@dataclass(slots=True)
class _Group:
    results: int = 0
    devices: set[tuple[str, str]] = field(default_factory=set)
    models: set[str | None] = field(default_factory=set)
    device_count: int | None = None
    """The number of devices where it is known without them (the summary's)."""


def _keys(source: _Source, by: str) -> list[ColumnElement[Any]]:
    return [*(source.column(name) for name in RESULT_GROUP), source.column(_GROUP_COLUMN[by])]


def _summaries(
    connection: Connection, source: _Source, by: str, conditions: list[Condition]
) -> dict[Key, _Group]:
    """Results, devices and models of every group, from one row per device (and stack).

    ``count(DISTINCT node, device)`` per group costs a temporary B-tree on SQLite (a second more
    for a million results) and a sort per group on PostgreSQL; grouping by device instead follows
    the order of the ``..._by_device`` index, which both stream without sorting, and what comes
    back is one row per device, workload and precision (and stack): tens of thousands in a large
    fleet, whatever the number of results.
    """
    names = [*RESULT_GROUP, "node", "device", "device_model"]
    if by == "stack":
        names.append("stack_id")
    columns = [source.column(name) for name in names]
    query = select(*columns, func.count()).where(*conditions).group_by(*columns)
    width = len(RESULT_GROUP)
    position = names.index(_GROUP_COLUMN[by])
    groups: dict[Key, _Group] = {}
    result = connection.execution_options(yield_per=STREAM_CHUNK).execute(query)
    for chunk in result.partitions():
        for row in chunk:
            key: Key = (*row[:width], row[position])
            group = groups.get(key)
            if group is None:
                group = groups[key] = _Group()
            group.results += row[-1]
            group.devices.add((row[width], row[width + 1]))
            group.models.add(row[width + 2])
    return groups


def _quantiles_in_sql(
    connection: Connection, source: _Source, by: str, conditions: list[Condition]
) -> dict[Key, tuple[float, float]]:
    """PostgreSQL: ``percentile_cont`` per group, over an index in group order."""
    value = source.column(source.value)
    keys = _keys(source, by)
    query = (
        select(
            *keys,
            *(func.percentile_cont(quantile).within_group(value) for quantile in QUANTILES),
        )
        .where(*conditions)
        .group_by(*keys)
    )
    width = len(keys)
    return {
        tuple(row[:width]): (float(row[width]), float(row[width + 1]))
        for row in connection.execute(query)
    }


def _quantiles_by_rank(
    connection: Connection,
    source: _Source,
    by: str,
    since: datetime | None,
    groups: dict[Key, _Group],
) -> dict[Key, tuple[float, float]]:
    """SQLite: the two values around each quantile's rank, read with ORDER BY ... OFFSET.

    SQLite has no percentile function, its window functions sort every row however they are
    indexed, and reading the values into Python costs about a microsecond each. A rank read from
    an index in value order within the group (``..._by_model``, ``..._by_stack``) is a walk
    through index entries in C, and two values a quantile are all that reach Python. Node groups
    (a few GPUs each) are small enough to sort. The group sizes come from the summaries, read in
    the same transaction.
    """
    names = (*RESULT_GROUP, "group")
    # The group may be NULL as well (runs archived before models and stacks were recorded).
    conditions: list[Condition] = [
        *source.where,
        *(
            column.is_not_distinct_from(bindparam(name))
            if name in _NULLABLE or name == "group"
            else column == bindparam(name)
            for column, name in zip(_keys(source, by), names, strict=True)
        ),
    ]
    if since is not None:
        conditions.append(_unindexed(source.column("ended_at")) >= since)
    value = source.column(source.value)
    query = select(value).where(*conditions).order_by(value).limit(2).offset(bindparam("rank"))
    quantiles: dict[Key, tuple[float, float]] = {}
    for key, group in groups.items():
        parameters = dict(zip(names, key, strict=True))
        figures = []
        for quantile in QUANTILES:
            position = (group.results - 1) * quantile
            rank = math.floor(position)
            values = connection.execute(query, {**parameters, "rank": rank}).scalars().all()
            if not values:  # cannot happen within one transaction; never index an empty list
                break
            figures.append(_lerp(values[0], values[-1], position - rank))
        if len(figures) == len(QUANTILES):
            quantiles[key] = (figures[0], figures[1])
    return quantiles


def _left_out_in_runs(
    connection: Connection, filters: dict[str, str | None], since: datetime | None, *, sqlite: bool
) -> list[tuple[str, int]]:
    """The runs left out, per reason: counted from ``ix_probe_runs_left_out``, in its order (one
    row per probe, outcome and classification comes back)."""
    keys = [probe_runs.c[name] for name in (*RUN_FILTERS, "outcome", "classification")]
    conditions: list[Condition] = [LEFT_OUT_WHERE, *_filters(probe_runs, filters, sqlite=sqlite)]
    if since is not None:
        ended = func.coalesce(probe_runs.c.ended_at, probe_runs.c.started_at, type_=UTCDateTime())
        conditions.append(ended >= since)
    query = select(*keys, func.count()).where(*conditions).group_by(*keys)
    return [
        (left_out_reason(outcome, classification), int(runs))
        for *_, outcome, classification, runs in connection.execute(query)
    ]


def _summarised(connection: Connection) -> bool:
    """Whether the database keeps the summary of both bases and of the runs left out
    (PostgreSQL since migration 0011)."""
    return summary.exists(connection, summary.LEFT_OUT_TABLE)


def _unblank(value: str) -> str | None:
    return value or None  # the summary keeps NULL keys as ''


def _key(names: Sequence[Any], group: str) -> Key:
    """A group's key from the summary's columns (RESULT_GROUP, the group), NULLs restored."""
    values = (
        _unblank(v) if n in _NULLABLE else v for n, v in zip(RESULT_GROUP, names, strict=True)
    )
    return (*values, _unblank(group))


def _summary_parameters(
    filters: dict[str, str | None], since: datetime | None
) -> tuple[dict[str, str], dict[str, Any]]:
    """The filters asked about, and the parameters of the summary's queries."""
    wanted = {name: value for name, value in filters.items() if value is not None}
    parameters: dict[str, Any] = dict(wanted)
    if since is not None:
        first_day = since.astimezone(UTC).date()
        parameters |= {
            "since": since,
            "first_day": first_day,
            "next_day": datetime.combine(first_day + timedelta(days=1), datetime.min.time(), UTC),
        }
    return wanted, parameters


def _from_summary(
    connection: Connection,
    source: _Source,
    by: str,
    filters: dict[str, str | None],
    since: datetime | None,
) -> tuple[dict[Key, _Group], dict[Key, tuple[float, float]]]:
    """PostgreSQL at fleet scale: the counts from the daily summary (agent.archive.summary),
    each quantile's exact value read from the results of the one bucket that holds its rank.

    The days after ``since``'s are the summary's; the rest of ``since``'s own day is counted
    from the results (one day at most). The answer is that of ``_summaries`` and
    ``_quantiles_in_sql`` over the same results (tests/test_fleet_scale.py compares them).
    """
    wanted, parameters = _summary_parameters(filters, since)
    parameters["grouping"] = by
    buckets: dict[Key, dict[int, int]] = {}
    query = summary.counts_query(by, source.basis, list(wanted), since=since is not None)
    for row in connection.execute(query, parameters):
        *names, group, bucket, count = row
        counts = buckets.setdefault(_key(names, group), {})
        counts[bucket] = counts.get(bucket, 0) + int(count)
    groups: dict[Key, _Group] = {}
    query = summary.devices_query(source.basis, list(wanted), since=since is not None)
    for row in connection.execute(query, parameters):
        *names, group, devices, low, high = row
        key = _key(names, group)
        results = sum(buckets.get(key, {}).values())
        if results <= 0:
            continue
        found = _Group(results=results, device_count=int(devices))
        found.models = {_unblank(low), _unblank(high)}
        groups[key] = found
    return groups, _quantiles_in_buckets(connection, source, by, groups, buckets, since=since)


def _left_out_from_summary(
    connection: Connection, filters: dict[str, str | None], since: datetime | None
) -> list[tuple[str, int]]:
    """PostgreSQL at fleet scale: the runs left out from the summary's per-day counts (and the
    rest of ``since``'s own day from the runs)."""
    wanted, parameters = _summary_parameters(filters, since)
    query = summary.left_out_query(list(wanted), since=since is not None)
    return [(str(reason), int(runs)) for reason, runs in connection.execute(query, parameters)]


RANK_BATCH = 100
"""Quantile lookups per statement (agent.archive.summary.rank_query)."""


def _reads(counts: dict[int, int], ranks: list[int]) -> list[tuple[int, int, int]]:
    """Where the results of ``ranks`` (consecutive, in value order) lie: reads of (bucket,
    offset within it, how many), from the results per bucket."""
    reads: list[tuple[int, int, int]] = []
    below, buckets = 0, iter(sorted(b for b, count in counts.items() if count > 0))
    bucket = next(buckets, None)
    for rank in ranks:
        while bucket is not None and below + counts[bucket] <= rank:
            below += counts[bucket]
            bucket = next(buckets, None)
        if bucket is None:
            break
        if reads and reads[-1][0] == bucket:
            reads[-1] = (bucket, reads[-1][1], reads[-1][2] + 1)
        else:
            reads.append((bucket, rank - below, 1))
    return reads


def _quantiles_in_buckets(
    connection: Connection,
    source: _Source,
    by: str,
    groups: dict[Key, _Group],
    buckets: dict[Key, dict[int, int]],
    *,
    since: datetime | None,
) -> dict[Key, tuple[float, float]]:
    """Each group's quantiles: for each, the bucket that holds its rank and the one after it
    (from the counts), then the values there, read in value order from an index of the bucket's
    results; the reads of every group of one shape (which keys are NULL) in one statement."""
    quantiles: list[tuple[Key, float, int]] = []  # (group, position, values wanted)
    reads: list[tuple[int, Key, tuple[int, int, int]]] = []  # (quantile, group, read)
    for key in groups:
        counts = buckets[key]
        total = sum(counts.values())
        for quantile in QUANTILES:
            position = (total - 1) * quantile
            rank = math.floor(position)
            ranks = [rank] if position == rank else [rank, rank + 1]
            reads += [(len(quantiles), key, found) for found in _reads(counts, ranks)]
            quantiles.append((key, position, len(ranks)))
    shapes: dict[tuple[bool, ...], list[int]] = {}
    for index, (_, key, _) in enumerate(reads):
        shapes.setdefault(tuple(value is None for value in key), []).append(index)
    values: dict[int, list[float]] = {}
    for nulls, indexes in shapes.items():
        for start in range(0, len(indexes), RANK_BATCH):
            batch = indexes[start : start + RANK_BATCH]
            parameters: dict[str, Any] = {} if since is None else {"since": since}
            for j, index in enumerate(batch):
                number, key, (bucket, offset, wanted) = reads[index]
                parameters |= {f"l{j}_i": number, f"l{j}_b": bucket}
                parameters |= {f"l{j}_o": offset, f"l{j}_n": wanted}
                parameters |= {f"l{j}_k{i}": v for i, v in enumerate(key) if v is not None}
            query = summary.rank_query(
                by, source.basis, list(nulls), len(batch), since=since is not None
            )
            for number, value in connection.execute(query, parameters):
                values.setdefault(number, []).append(value)
    figures: dict[Key, list[float]] = {}
    disagree: set[Key] = set()
    for number, (key, position, wanted) in enumerate(quantiles):
        found = sorted(values.get(number, []))
        if len(found) != wanted:  # the summary and the results disagree: never guess
            disagree.add(key)  # the group is left out
            continue
        # PostgreSQL's own interpolation (percentile_cont's), so that the answer is the
        # unsummarised query's to the last bit.
        low, high = found[0], found[-1]
        figures.setdefault(key, []).append(low + (high - low) * (position - math.floor(position)))
    return {
        key: (found[0], found[1])
        for key, found in figures.items()
        if key not in disagree and len(found) == len(QUANTILES)
    }


def _lerp(low: float, high: float, fraction: float) -> float:
    """Linear interpolation as numpy's quantile does it (from the nearer end), to the last bit."""
    difference = high - low
    if fraction >= 0.5:
        return float(high - difference * (1 - fraction))
    return float(low + difference * fraction)


def _row(key: Key, group: _Group, quantiles: tuple[float, float], basis: str) -> CapacityRow:
    measured = dict(zip(RESULT_GROUP, key[:-1], strict=True))
    median, p10 = quantiles
    model = next(iter(group.models)) if len(group.models) == 1 else None
    peak = spec_peak(model, measured["workload"], measured["precision"], measured["unit"])
    if measured["scope"] == "node_total":  # a node's sum over the peak of one of its devices
        peak = None
    return CapacityRow(
        group=key[-1],
        **measured,
        basis=basis,
        median=median,
        p10=p10,
        results=group.results,
        devices=len(group.devices) if group.device_count is None else group.device_count,
        spec_ratio=median / peak if peak else None,
    )


# --since

_DURATION = re.compile(r"(\d+)\s*([smhdw])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}


def parse_since(text: str, now: datetime) -> datetime:
    """The instant ``--since`` names: a duration back from ``now`` (``7d``, ``24h``, ``30m``,
    ``45s``, ``2w``) or an ISO 8601 date or date and time, in UTC unless it gives its offset.

    Raises ValueError with a message fit to show the user as it is.
    """
    now = now if now.tzinfo is not None else now.replace(tzinfo=UTC)
    stripped = text.strip()
    duration = _DURATION.fullmatch(stripped.lower())
    if duration is not None:
        amount, unit = int(duration.group(1)), duration.group(2)
        if amount == 0:
            raise ValueError(f"--since {text!r}: the duration must be more than zero")
        try:
            return (now - timedelta(seconds=amount * _UNIT_SECONDS[unit])).astimezone(UTC)
        except OverflowError:
            raise ValueError(f"--since {text!r}: the duration is too long") from None
    try:
        when = datetime.fromisoformat(stripped)
    except ValueError:
        raise ValueError(
            f"--since {text!r} is neither a duration (7d, 24h, 30m) nor an ISO 8601 date or "
            "time (2026-11-01, 2026-11-01T08:00:00Z)"
        ) from None
    when = when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)
    if when > now:
        raise ValueError(f"--since {text!r} is in the future")
    return when
