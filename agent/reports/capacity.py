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

The percentiles are those of numpy's default and of PostgreSQL's ``percentile_cont``: linear
interpolation between the two nearest ranks. A fleet's archive holds millions of results, so no
query here reads them all into Python or sorts them all: the counts come from one row per device
and group (``_summaries``), PostgreSQL computes the percentiles with ``percentile_cont``, and
SQLite, which has no percentile function, reads the two values around each rank from an index in
value order (``_quantiles_by_rank``). The partial covering indexes ``ix_probe_runs_results_by_*``
(``agent.archive.models``) are what keep a query over a million results near a second
(``bench/capacity.py``); reading the values into Python and numpy, one group at a time, took
ten.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import groupby
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    Float,
    String,
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
from agent.archive.models import RESULT_GROUP, UTCDateTime
from agent.reports.specs import spec_peak

GROUPINGS = ("model", "node", "stack")

# The view of migration 0005 (ok runs with a steady value), described for queries only: the
# models map tables, and a view must not be created by ``create_all`` or autogenerate.
probe_results = table(
    "probe_results",
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
    column("steady_throughput", Float),
)
_GROUP_COLUMN = {"model": "device_model", "node": "node", "stack": "stack_id"}
# Columns of RESULT_GROUP that runs archived before they were recorded leave NULL.
_NULLABLE = frozenset({"unit", "size"})
FILTERS = ("precision", "workload", "optimization", "size", "scope")

SCOPES = ("device", "node", "node_total")
"""A run's scope (``probe_runs.scope``), in the order the rows of one group and size are shown:
solo, then each device within a node-wide run, then the node-wide run's sum over the node."""
SCOPE_SHOWN = {"device": "solo", "node": "node-wide", "node_total": "node-total"}

STREAM_CHUNK = 20_000
"""Summary rows fetched at a time (through a server-side cursor on PostgreSQL)."""

QUANTILES = (0.5, 0.1)


@dataclass(frozen=True, slots=True)
class CapacityRow:
    """One group's sustained throughput for one (workload, precision, optimization, size, unit).

    ``group`` is the device model, node or stack id (None where the runs did not record it:
    runs archived before stacks and models were); ``size`` the problem size (None for runs
    archived without it); ``scope`` one of SCOPES (runs archived before node-wide runs are
    ``device``). ``median`` and ``p10`` are in ``unit``. ``spec_ratio`` is ``median`` over the
    model's published peak; None where the peak is not known, the group mixes models (a node or
    a stack may span several) or the figures are a node's sum (the peak is a device's).
    """

    group: str | None
    workload: str
    precision: str
    optimization: str
    size: str | None
    scope: str
    unit: str | None
    median: float
    p10: float
    results: int
    devices: int
    spec_ratio: float | None


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
    group, size, scope in the order of SCOPES).

    ``since`` keeps the runs that ended at or after it (an aware datetime). Raises ValueError for
    an unknown ``by`` or ``scope`` and ArchiveError when the database cannot be read.

    Two queries: one row per device (``_summaries``: results, devices, models), then the
    quantiles of each group; both in one transaction, so that they count the same results.
    """
    if by not in GROUPINGS:
        raise ValueError(f"cannot group by {by!r}: expected one of {', '.join(GROUPINGS)}")
    if scope is not None and scope not in SCOPES:
        raise ValueError(f"no scope {scope!r}: expected one of {', '.join(SCOPES)}")
    if since is not None and since.tzinfo is None:
        raise ValueError(f"naive datetime {since.isoformat()} for since (expected UTC)")
    filters = {
        "precision": precision,
        "workload": workload,
        "optimization": optimization,
        "size": size,
        "scope": scope,
    }
    try:
        with engine.connect() as connection:
            postgresql = connection.dialect.name == "postgresql"
            if postgresql:
                # SQLite's transaction sees one snapshot; PostgreSQL's default, one per query.
                connection.execution_options(isolation_level="REPEATABLE READ")
            conditions = _conditions(filters, since, sqlite=not postgresql)
            if postgresql and by in summary.GROUPINGS and _summarised(connection):
                groups, quantiles = _from_summary(connection, by, filters, since)
            else:
                groups = _summaries(connection, by, conditions)
                if postgresql:
                    quantiles = _quantiles_in_sql(connection, by, conditions)
                else:
                    quantiles = _quantiles_by_rank(connection, by, since, groups)
            rows = [
                _row(key, group, quantiles[key])
                for key, group in groups.items()
                if key in quantiles
            ]
    except SQLAlchemyError as exc:
        raise archive_error("query", engine, exc) from exc
    rows.sort(key=_order)
    return rows


@dataclass(frozen=True, slots=True)
class ResultsOverview:
    """What the archive's results could have matched: for saying why a query found none."""

    newest: datetime | None
    """When the newest result ended; None where the archive has no result at all."""
    known: dict[str, list[str]]
    """Each filter asked about, with its values among all the results, sorted."""


def overview(engine: Engine, filters: Iterable[str]) -> ResultsOverview:
    """The newest result's end, and the known values of ``filters`` (names in FILTERS).

    For a query that found nothing: each DISTINCT reads a whole index.
    """
    c = probe_results.c
    names = list(filters)
    if unknown := [name for name in names if name not in FILTERS]:
        raise ValueError(f"cannot list the values of {', '.join(unknown)}")
    try:
        with engine.connect() as connection:
            newest = connection.execute(select(func.max(c.ended_at))).scalar()
            known = {
                name: sorted(
                    connection.execute(select(c[name]).where(c[name].is_not(None)).distinct())
                    .scalars()
                    .all()
                )
                for name in names
            }
    except SQLAlchemyError as exc:
        raise archive_error("query", engine, exc) from exc
    return ResultsOverview(newest, known)


def _order(row: CapacityRow) -> tuple[object, ...]:
    return (
        *_section(row),
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


def _conditions(
    filters: dict[str, str | None], since: datetime | None, *, sqlite: bool
) -> list[ColumnElement[bool]]:
    c = probe_results.c
    conditions: list[ColumnElement[bool]] = []
    for name, value in filters.items():
        if value is not None:
            column = c[name] if name == "precision" or not sqlite else _unindexed(c[name])
            conditions.append(column == value)
    if since is not None:
        conditions.append((_unindexed(c.ended_at) if sqlite else c.ended_at) >= since)
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


def _keys(by: str) -> list[ColumnElement[Any]]:
    c = probe_results.c
    return [*(c[name] for name in RESULT_GROUP), c[_GROUP_COLUMN[by]]]


def _summaries(
    connection: Connection, by: str, conditions: list[ColumnElement[bool]]
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
    columns = [probe_results.c[name] for name in names]
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
    connection: Connection, by: str, conditions: list[ColumnElement[bool]]
) -> dict[Key, tuple[float, float]]:
    """PostgreSQL: ``percentile_cont`` per group, over an index in group order."""
    steady = probe_results.c.steady_throughput
    keys = _keys(by)
    query = (
        select(
            *keys,
            *(func.percentile_cont(quantile).within_group(steady) for quantile in QUANTILES),
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
    connection: Connection, by: str, since: datetime | None, groups: dict[Key, _Group]
) -> dict[Key, tuple[float, float]]:
    """SQLite: the two values around each quantile's rank, read with ORDER BY ... OFFSET.

    SQLite has no percentile function, its window functions sort every row however they are
    indexed, and reading the values into Python costs about a microsecond each. A rank read from
    an index in value order within the group (``..._by_model``, ``..._by_stack``) is a walk
    through index entries in C, and two values a quantile are all that reach Python. Node groups
    (a few GPUs each) are small enough to sort. The group sizes come from the summaries, read in
    the same transaction.
    """
    c = probe_results.c
    names = (*RESULT_GROUP, "group")
    # The group may be NULL as well (runs archived before models and stacks were recorded).
    conditions = [
        column.is_not_distinct_from(bindparam(name))
        if name in _NULLABLE or name == "group"
        else column == bindparam(name)
        for column, name in zip(_keys(by), names, strict=True)
    ]
    if since is not None:
        conditions.append(_unindexed(c.ended_at) >= since)
    query = (
        select(c.steady_throughput)
        .where(*conditions)
        .order_by(c.steady_throughput)
        .limit(2)
        .offset(bindparam("rank"))
    )
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


def _summarised(connection: Connection) -> bool:
    """Whether the database keeps the daily summary (PostgreSQL since migration 0010)."""
    found = connection.exec_driver_sql("SELECT to_regclass('probe_result_days')").scalar()
    return found is not None


def _unblank(value: str) -> str | None:
    return value or None  # the summary keeps NULL keys as ''


def _key(names: Sequence[Any], group: str) -> Key:
    """A group's key from the summary's columns (RESULT_GROUP, the group), NULLs restored."""
    values = (
        _unblank(v) if n in _NULLABLE else v for n, v in zip(RESULT_GROUP, names, strict=True)
    )
    return (*values, _unblank(group))


def _from_summary(
    connection: Connection, by: str, filters: dict[str, str | None], since: datetime | None
) -> tuple[dict[Key, _Group], dict[Key, tuple[float, float]]]:
    """PostgreSQL at fleet scale: the counts from the daily summary (agent.archive.summary),
    each quantile's exact value read from the results of the one bucket that holds its rank.

    The days after ``since``'s are the summary's; the rest of ``since``'s own day is counted
    from the results (one day at most). The answer is that of ``_summaries`` and
    ``_quantiles_in_sql`` over the same results (tests/test_fleet_scale.py compares them).
    """
    wanted = {name: value for name, value in filters.items() if value is not None}
    parameters: dict[str, Any] = {"grouping": by, **wanted}
    if since is not None:
        first_day = since.astimezone(UTC).date()
        parameters |= {
            "since": since,
            "first_day": first_day,
            "next_day": datetime.combine(first_day + timedelta(days=1), datetime.min.time(), UTC),
        }
    buckets: dict[Key, dict[int, int]] = {}
    query = summary.counts_query(by, list(wanted), since=since is not None)
    for row in connection.execute(query, parameters):
        *names, group, bucket, count = row
        counts = buckets.setdefault(_key(names, group), {})
        counts[bucket] = counts.get(bucket, 0) + int(count)
    groups: dict[Key, _Group] = {}
    query = summary.devices_query(list(wanted), since=since is not None)
    for row in connection.execute(query, parameters):
        *names, group, devices, low, high = row
        key = _key(names, group)
        results = sum(buckets.get(key, {}).values())
        if results <= 0:
            continue
        found = _Group(results=results, device_count=int(devices))
        found.models = {_unblank(low), _unblank(high)}
        groups[key] = found
    return groups, _quantiles_in_buckets(connection, by, groups, buckets, since)


RANK_BATCH = 100
"""Quantile lookups per statement (agent.archive.summary.rank_query)."""


def _quantiles_in_buckets(
    connection: Connection,
    by: str,
    groups: dict[Key, _Group],
    buckets: dict[Key, dict[int, int]],
    since: datetime | None,
) -> dict[Key, tuple[float, float]]:
    """Each group's quantiles: for each, the bucket that holds its rank (from the counts), then
    the two values around the rank, read from an index in (bucket, value) order from there; the
    lookups of every group of one shape (which keys are NULL) in one statement."""
    lookups: list[tuple[Key, float, dict[str, Any]]] = []  # (group, position, parameters)
    for key in groups:
        counts = buckets[key]
        total = sum(counts.values())
        for quantile in QUANTILES:
            position = (total - 1) * quantile
            rank = math.floor(position)
            below, number = 0, min(counts)
            for number in sorted(counts):
                if below + counts[number] > rank:
                    break
                below += counts[number]
            lookups.append((key, position, {"b": number, "o": rank - below}))
    shapes: dict[tuple[bool, ...], list[int]] = {}
    for index, (key, _, _) in enumerate(lookups):
        shapes.setdefault(tuple(value is None for value in key), []).append(index)
    values: dict[int, list[float]] = {}
    for nulls, indexes in shapes.items():
        for start in range(0, len(indexes), RANK_BATCH):
            batch = indexes[start : start + RANK_BATCH]
            parameters: dict[str, Any] = {} if since is None else {"since": since}
            for j, index in enumerate(batch):
                key, _, found = lookups[index]
                parameters |= {f"l{j}_i": index, f"l{j}_b": found["b"], f"l{j}_o": found["o"]}
                parameters |= {f"l{j}_k{i}": v for i, v in enumerate(key) if v is not None}
            query = summary.rank_query(by, list(nulls), len(batch), since=since is not None)
            for index, value in connection.execute(query, parameters):
                values.setdefault(index, []).append(value)
    quantiles: dict[Key, list[float]] = {}
    for index, (key, position, _) in enumerate(lookups):
        pair = sorted(values.get(index, []))
        if not pair:  # the summary and the results disagree: never guess; the group is left out
            quantiles[key] = []
            continue
        # PostgreSQL's own interpolation (percentile_cont's), so that the answer is the
        # unsummarised query's to the last bit.
        low, high = pair[0], pair[-1]
        quantiles.setdefault(key, []).append(low + (high - low) * (position - math.floor(position)))
    return {
        key: (figures[0], figures[1])
        for key, figures in quantiles.items()
        if len(figures) == len(QUANTILES)
    }


def _lerp(low: float, high: float, fraction: float) -> float:
    """Linear interpolation as numpy's quantile does it (from the nearer end), to the last bit."""
    difference = high - low
    if fraction >= 0.5:
        return float(high - difference * (1 - fraction))
    return float(low + difference * fraction)


def _row(key: Key, group: _Group, quantiles: tuple[float, float]) -> CapacityRow:
    measured = dict(zip(RESULT_GROUP, key[:-1], strict=True))
    median, p10 = quantiles
    model = next(iter(group.models)) if len(group.models) == 1 else None
    peak = spec_peak(model, measured["workload"], measured["precision"], measured["unit"])
    if measured["scope"] == "node_total":  # a node's sum over the peak of one of its devices
        peak = None
    return CapacityRow(
        group=key[-1],
        **measured,
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


# Output

_PREFIXES = {-3: "n", -2: "µ", -1: "m", 0: "", 1: "k", 2: "M", 3: "G", 4: "T", 5: "P", 6: "E"}


def _scaled(value: float) -> tuple[str, str]:
    """Four significant digits and the SI prefix that goes with them: ``("812.3", "T")``."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}", ""
    power = max(min(math.floor(math.log10(abs(value)) / 3), 6), -3)
    scaled = value / 1000.0**power
    if round(abs(scaled), 1) >= 1000 and power < 6:  # 999.96 would print as 1000.0
        power += 1
        scaled = value / 1000.0**power
    size = abs(scaled)
    digits = 1 if round(size, 2) >= 100 else 2 if round(size, 3) >= 10 else 3
    return f"{scaled:.{digits}f}", _PREFIXES[power]


def human(value: float, unit: str | None) -> str:
    """``812.3 TFLOP/s``: four significant digits and an SI prefix on the unit."""
    number, prefix = _scaled(value)
    return f"{number} {prefix}{unit or ''}".rstrip()


def _figure(value: float) -> str:
    """A table cell of a section whose heading gives the unit: ``812.3 T``, ``12.50  `` (a blank
    where the prefix would be, so that the digits line up)."""
    number, prefix = _scaled(value)
    return f"{number} {prefix or ' '}"


STACK_ID_SHOWN = 12
"""Characters of a stack id in the table (a SHA-256: as unique as a short git hash)."""

TABLE_WIDTH = 80
"""The width the table fits when the caller knows none (no terminal)."""

# The columns after the group's (model, node or stack), as in ``_cells``; the first ``_LEFT``
# columns, the group's included, are words (left-aligned), the others numbers.
_HEADER = ("SIZE", "SCOPE", "MEDIAN", "P10", "SPEC", "RESULTS", "DEVICES")
_LEFT = 3
_GROUP_ROOM = 12
"""The narrowest group column worth a table: below it, a block per row."""


def _section(row: CapacityRow) -> tuple[object, ...]:
    """What one section of the table measured: a probe and the unit of its figures."""
    return (row.workload, row.precision, row.optimization, row.unit is None, row.unit or "")


def _heading(row: CapacityRow) -> str:
    unit = row.unit or "unit not recorded"
    return f"{row.workload} {row.precision} {row.optimization} ({unit})"


def _cells(row: CapacityRow, by: str, *, units: bool = False) -> tuple[str, ...]:
    """The row's cells: figures with their prefix only (``units``: and with the unit)."""
    group = row.group if row.group is not None else "-"
    if by == "stack" and row.group is not None:
        group = group[:STACK_ID_SHOWN]

    def figure(value: float) -> str:
        return human(value, row.unit) if units else _figure(value)

    return (
        group,
        row.size or "-",
        SCOPE_SHOWN.get(row.scope, row.scope),
        figure(row.median),
        figure(row.p10),
        f"{row.spec_ratio:.1%}" if row.spec_ratio is not None else "-",
        str(row.results),
        str(row.devices),
    )


def render_table(rows: Sequence[CapacityRow], by: str = "model", width: int = TABLE_WIDTH) -> str:
    """A section per probe (workload, precision, optimization, with the unit of its figures in
    the heading) and in it a line per group, size and scope (SCOPE_SHOWN: solo, node-wide,
    node-total), numbers right-aligned with an SI prefix.

    Nothing is ever cut to fit ``width``: a group name too long for its column (at 80 columns,
    over about 21 characters, 16 beside node-wide rows, as many model names are) stands on a
    line of its own, its figures on the next, as df puts a long file system name; where not even
    the figures fit, every row becomes a block of one column a line.
    """
    if not rows:
        return "no probe results match"
    header = (by.upper(), *_HEADER)
    table = [header, *(_cells(row, by) for row in rows)]
    widths = [max(len(cells[i]) for cells in table) for i in range(len(header))]
    room = width - sum(widths[1:]) - 2 * (len(widths) - 1)
    if room < _GROUP_ROOM:
        return _blocks(rows, header, by)
    widths[0] = min(widths[0], room)

    def lines(cells: tuple[str, ...]) -> list[str]:
        if len(cells[0]) > widths[0]:
            return [cells[0], *lines(("", *cells[1:]))]
        return [
            "  ".join(
                cell.ljust(size) if i < _LEFT else cell.rjust(size)
                for i, (cell, size) in enumerate(zip(cells, widths, strict=True))
            ).rstrip()
        ]

    return "\n\n".join(
        "\n".join(
            [heading, *lines(header), *(line for row in members for line in lines(_cells(row, by)))]
        )
        for heading, members in groupby(rows, key=_heading)
    )


def _blocks(rows: Sequence[CapacityRow], header: tuple[str, ...], by: str) -> str:
    """The vertical layout: under each section's heading, a block per row, a line per column."""
    pad = max(len(label) for label in header) + 2
    return "\n\n".join(
        heading
        + "\n"
        + "\n\n".join(
            "\n".join(
                f"  {label.ljust(pad)}{value}"
                for label, value in zip(header, _cells(row, by, units=True), strict=True)
            )
            for row in members
        )
        for heading, members in groupby(rows, key=_heading)
    )


def rows_as_json(rows: Iterable[CapacityRow]) -> list[dict[str, Any]]:
    """The rows as JSON objects, with full precision and full stack ids."""
    return [asdict(row) for row in rows]
