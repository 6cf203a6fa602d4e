"""The planner's report, as data: what ``sustain report fleet`` puts on its page.

Sustained throughput per model and probe comes from ``agent.reports.capacity`` (the same medians
and p10 as ``sustain capacity``, on the same bases: every ok run counts, on its steady value or,
without a steady state, on its p10 over one-second windows; and the same count of the runs used
and left out); the rest are small aggregate queries over the same results and the events table:
the runs' mean peak and sustained ratio, drift, stack and health events, the throttling each
device saw, and what was run on which stacks (the methods section). Every query aggregates in the
database, so a fleet's archive is never read into Python whole; the events are capped at
``MAX_EVENTS``, newest kept.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Engine, and_, case, func, or_, select, true
from sqlalchemy.exc import SQLAlchemyError

from agent.archive.database import archive_error
from agent.archive.models import (
    P10_RESULTS_WHERE,
    RESULTS_WHERE,
    EventRecord,
    ProbeRunRecord,
    StackSnapshotRecord,
)
from agent.reports.capacity import CapacityRow, RunsCounted, capacity_with_runs
from agent.reports.specs import spec_peak

TIMELINE_KINDS = ("drift", "stack_changed", "health_change")
MAX_EVENTS = 500
MAX_EPISODES = 20_000


@dataclass(frozen=True, slots=True)
class ThroughputRow:
    """A capacity row (model, probe, size, scope, basis) with the runs' mean peak and the
    spec; a row of the p10 basis has no sustained ratio (its runs had no steady value)."""

    capacity: CapacityRow
    peak: float | None  # mean of the runs' peaks (best 5% window of each run)
    spec: float | None  # the model's published dense peak, in the same unit
    sustained_ratio: float | None  # mean of the runs' steady / peak
    min_sustained_ratio: float | None


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    kind: str
    node: str
    device: str
    occurred_at: datetime
    message: str
    attributes: dict[str, str]


@dataclass(frozen=True, slots=True)
class HotSpot:
    """One device's throttling: its results' steady segments and its throttle episodes."""

    node: str
    device: str
    device_label: str
    device_model: str | None
    results: int
    thermal_share: float | None  # mean share of the steady segment under a thermal reason
    power_share: float | None
    episodes: dict[str, tuple[int, float]] = field(default_factory=dict)  # reason -> n, seconds

    @property
    def score(self) -> float:
        return max(self.thermal_share or 0.0, self.power_share or 0.0)


@dataclass(frozen=True, slots=True)
class StackCovered:
    stack_id: str | None
    results: int
    nodes: int
    driver: str | None
    cuda: str | None
    torch: str | None


@dataclass(frozen=True, slots=True)
class ProbeCovered:
    workload: str
    precision: str
    optimization: str
    size: str | None
    scope: str
    results: int
    devices: int


@dataclass(frozen=True, slots=True)
class FleetData:
    since: datetime | None
    generated_at: datetime
    throughput: tuple[ThroughputRow, ...]
    events: tuple[TimelineEvent, ...]
    hot_spots: tuple[HotSpot, ...]
    stacks: tuple[StackCovered, ...]
    probes: tuple[ProbeCovered, ...]
    outcomes: dict[str, int]  # every run in the period, by outcome
    runs: RunsCounted  # the runs behind the figures, by basis, and those left out, by reason
    nodes: int
    devices: int
    results: int  # the runs used, on either basis
    tolerances: tuple[float, ...]  # the analysis' tolerance, as the runs recorded it

    @property
    def empty(self) -> bool:
        return self.results == 0


def gather(engine: Engine, since: datetime | None, now: datetime) -> FleetData:
    """Everything the page shows, from runs that ended at or after ``since`` (every run when
    None). Raises ArchiveError when the database cannot be read."""
    record = ProbeRunRecord
    after = true() if since is None else record.ended_at >= since
    results = and_(or_(RESULTS_WHERE, P10_RESULTS_WHERE), after)
    steady = and_(RESULTS_WHERE, after)
    try:
        answer = capacity_with_runs(engine, by="model", since=since)
        with engine.connect() as connection:
            means = _means(connection, results)
            totals = connection.execute(
                select(
                    func.count(),
                    func.count(func.distinct(record.node)),
                    func.count(func.distinct(record.node + "/" + record.device)),
                ).where(results)
            ).one()
            outcomes = dict(
                connection.execute(
                    select(record.outcome, func.count()).where(after).group_by(record.outcome)
                ).all()
            )
            data = FleetData(
                since=since,
                generated_at=now,
                throughput=tuple(_throughput(row, means) for row in answer.rows),
                events=_events(connection, since),
                hot_spots=_hot_spots(connection, steady, since),
                stacks=_stacks(connection, results),
                probes=_probes(connection, results),
                outcomes={str(k): int(v) for k, v in outcomes.items()},
                runs=answer.runs,
                nodes=int(totals[1]),
                devices=int(totals[2]),
                results=int(totals[0]),
                tolerances=_tolerances(connection, results),
            )
    except SQLAlchemyError as exc:
        raise archive_error("read the fleet report from", engine, exc) from exc
    return data


Key = tuple[Any, ...]


def _means(connection: Any, results: Any) -> dict[Key, tuple[Any, Any, Any]]:
    r = ProbeRunRecord
    basis = case((r.steady_throughput.is_not(None), "steady"), else_="p10")
    keys = (r.device_model, r.workload, r.precision, r.optimization, r.unit, r.size, r.scope, basis)
    statement = (
        select(
            *keys,
            func.avg(r.peak_throughput),
            func.avg(r.sustained_ratio),
            func.min(r.sustained_ratio),
        )
        .where(results)
        .group_by(*keys)
    )
    width = len(keys)
    return {
        tuple(row[:width]): (row[width], row[width + 1], row[width + 2])
        for row in connection.execute(statement)
    }


def _throughput(row: CapacityRow, means: dict[Key, tuple[Any, Any, Any]]) -> ThroughputRow:
    key = (
        row.group,
        row.workload,
        row.precision,
        row.optimization,
        row.unit,
        row.size,
        row.scope,
        row.basis,
    )
    peak, ratio, lowest = means.get(key, (None, None, None))
    spec = None
    if row.scope != "node_total":
        spec = spec_peak(row.group, row.workload, row.precision, row.unit)
    return ThroughputRow(
        row,
        None if peak is None else float(peak),
        spec,
        None if ratio is None else float(ratio),
        None if lowest is None else float(lowest),
    )


def _events(connection: Any, since: datetime | None) -> tuple[TimelineEvent, ...]:
    e = EventRecord
    where: ColumnElement[bool] = e.kind.in_(TIMELINE_KINDS)
    if since is not None:
        where = and_(where, e.occurred_at >= since)
    statement = (
        select(e.kind, e.node, e.device, e.occurred_at, e.message, e.attributes)
        .where(where)
        .order_by(e.occurred_at.desc())
        .limit(MAX_EVENTS)
    )
    events = [
        TimelineEvent(kind, node, device, at, message, _attributes(attributes))
        for kind, node, device, at, message, attributes in connection.execute(statement)
    ]
    return tuple(reversed(events))


def _attributes(text: str | None) -> dict[str, str]:
    return {str(k): str(v) for k, v in _json_object(text).items()}


def _hot_spots(connection: Any, results: Any, since: datetime | None) -> tuple[HotSpot, ...]:
    r = ProbeRunRecord
    keys = (r.node, r.device, r.device_label, r.device_model)
    statement = (
        select(
            *keys,
            func.count(),
            func.avg(r.steady_thermal_share),
            func.avg(r.steady_power_share),
        )
        .where(results)
        .group_by(*keys)
    )
    devices = {(row[0], row[1]): row for row in connection.execute(statement)}
    episodes: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(dict)
    e = EventRecord
    where: ColumnElement[bool] = e.kind == "throttle_episode"
    if since is not None:
        where = and_(where, e.occurred_at >= since)
    for node, device, attributes in connection.execute(
        select(e.node, e.device, e.attributes)
        .where(where)
        .order_by(e.occurred_at.desc())
        .limit(MAX_EPISODES)
    ):
        values = _attributes(attributes)
        reason = values.get("reason", "unknown")
        tally = episodes[(node, device)].setdefault(reason, [0.0, 0.0])
        tally[0] += 1
        tally[1] += _float(values.get("seconds")) or 0.0
    spots = []
    for key in sorted(set(devices) | set(episodes)):
        row = devices.get(key)
        spots.append(
            HotSpot(
                node=key[0],
                device=key[1],
                device_label=key[1] if row is None else row[2],
                device_model=None if row is None else row[3],
                results=0 if row is None else int(row[4]),
                thermal_share=None if row is None else _float(row[5]),
                power_share=None if row is None else _float(row[6]),
                episodes={
                    reason: (int(count), seconds)
                    for reason, (count, seconds) in sorted(episodes.get(key, {}).items())
                },
            )
        )
    return tuple(sorted(spots, key=lambda spot: (-spot.score, spot.node, spot.device)))


def _float(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def _stacks(connection: Any, results: Any) -> tuple[StackCovered, ...]:
    r, s = ProbeRunRecord, StackSnapshotRecord
    counts = connection.execute(
        select(r.stack_id, func.count(), func.count(func.distinct(r.node)))
        .where(results)
        .group_by(r.stack_id)
    ).all()
    ids = [stack_id for stack_id, _, _ in counts if stack_id is not None]
    versions = {
        row[0]: row[1:]
        for row in connection.execute(
            select(s.stack_id, s.driver_version, s.cuda_version, s.torch_version).where(
                s.stack_id.in_(ids)
            )
        )
    }
    stacks = [
        StackCovered(stack_id, int(n), int(nodes), *versions.get(stack_id, (None, None, None)))
        for stack_id, n, nodes in counts
    ]
    return tuple(sorted(stacks, key=lambda stack: (-stack.results, stack.stack_id or "")))


def _probes(connection: Any, results: Any) -> tuple[ProbeCovered, ...]:
    r = ProbeRunRecord
    keys = (r.workload, r.precision, r.optimization, r.size, r.scope)
    statement = (
        select(*keys, func.count(), func.count(func.distinct(r.node + "/" + r.device)))
        .where(results)
        .group_by(*keys)
        .order_by(*keys)
    )
    return tuple(
        ProbeCovered(
            workload=row[0],
            precision=row[1],
            optimization=row[2],
            size=row[3],
            scope=row[4],
            results=int(row[5]),
            devices=int(row[6]),
        )
        for row in connection.execute(statement)
    )


def _tolerances(connection: Any, results: Any) -> tuple[float, ...]:
    """The analysis' tolerance of the newest results (it is in each run's analysis JSON)."""
    r = ProbeRunRecord
    texts = connection.execute(
        select(r.analysis).where(results).order_by(r.ended_at.desc()).limit(200)
    ).scalars()
    found: set[float] = set()
    for text in texts:
        value = _json_object(text).get("tolerance")
        if isinstance(value, int | float):
            found.add(float(value))
    return tuple(sorted(found))


def _json_object(text: str | None) -> dict[str, Any]:
    """A JSON object kept in a text column (an event's attributes, a run's analysis); an
    empty one for anything else."""
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def coupling_pairs(rows: Sequence[ThroughputRow]) -> list[tuple[ThroughputRow, ThroughputRow]]:
    """(solo, node-wide) rows of the same model, probe, size and basis: where both were run (a
    steady figure is never set against a p10)."""
    solo = {_probe_key(row): row for row in rows if row.capacity.scope == "device"}
    return [
        (solo[_probe_key(row)], row)
        for row in rows
        if row.capacity.scope == "node" and _probe_key(row) in solo
    ]


def _probe_key(row: ThroughputRow) -> Key:
    c = row.capacity
    return (c.group, c.workload, c.precision, c.optimization, c.unit, c.size, c.basis)
