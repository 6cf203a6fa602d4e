"""Drift: a lasting change in a device's sustained throughput across probe results, and its cause.

For each series (node, device, workload, precision, optimization) the steady values of the last
``history`` analysed solo runs, in time order, go through E-Divisive means with a t-test
(agent/analysis/edivisive.py; window, p-value and minimum magnitude from ``[drift]``). Solo only
(scope ``device``), here and for the fleet outliers: in a node-wide run every device of the node
works at once, under another load, and a lower figure there is coupling, not drift. Each change
point is attributed by comparing the runs on either side of it (up to the neighbouring change
points):

- ``stack``: the stack most runs ran on differs between the two sides; the explanation is the
  stack diff ("driver.version 550.54.15 -> 555.42.02, ...");
- ``thermal``: the steady segments spent a larger share of time in thermal throttling (at least 10
  points more) after the change, or ran at least 5 degrees hotter with lower clocks;
- ``power``: likewise with power-brake or power-cap throttling;
- ``clocks``: the SM clock moved by more than half the throughput change, for no throttle reason
  NVML reports;
- ``unexplained``: none of these.

Fleet outliers compare devices that should perform alike: same model, same stack, same probe. A
device whose recent median (its last ``RECENT`` results) is more than ``outlier_ratio`` below the
median of its peers (at least ``MIN_PEERS`` devices) is flagged. ``sustain drift`` computes them
from the whole archive's history (``fleet_outliers``); the daemon's child on a fleet's
PostgreSQL reads its node's own history and a row per group from the fleet's baselines
(``outliers_by_key``, agent.archive.fleet_baselines: one agent's pass a period), the same answer
without reading the peers' results.

It imports numpy and scipy (through agent.analysis), so the daemon runs it in a child process
(``python -m agent.drift.detect``); the CLI's ``sustain drift`` imports it directly.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.exc import SQLAlchemyError

from agent.analysis.edivisive import change_points
from agent.archive import fleet_baselines
from agent.archive.database import ArchiveError, archive_error, open_engine
from agent.archive.models import ProbeRunRecord
from agent.archive.stack_snapshots import facts_by_id
from agent.stack.tracker import summary
from collectors.stack import diff

RECENT = fleet_baselines.RECENT
MIN_PEERS = 3
THERMAL_SHARE_STEP = 0.10
TEMPERATURE_STEP = 5.0

SeriesKey = tuple[str, str, str, str, str]  # node, device, workload, precision, optimization


@dataclass(frozen=True, slots=True)
class Result:
    """One analysed run as drift detection reads it."""

    run_id: str
    ended_at: datetime
    steady: float
    stack_id: str | None
    device_label: str
    device_model: str | None
    unit: str | None
    sm_clock_hertz: float | None
    temperature_celsius: float | None
    thermal_share: float | None
    power_share: float | None
    row_id: int = 0  # probe_runs.id: whether the fleet's pass saw it (fleet_baselines)


@dataclass(frozen=True, slots=True)
class Drift:
    node: str
    device: str
    device_label: str
    device_model: str | None
    workload: str
    precision: str
    optimization: str
    unit: str | None
    at: datetime  # the first result after the change
    run_id: str  # that result's run
    before: float
    after: float
    change: float  # after / before - 1
    pvalue: float
    direction: str  # regression | improvement
    cause: str  # stack | thermal | power | clocks | unexplained
    explanation: str
    stack_before: str | None
    stack_after: str | None

    @property
    def event_id(self) -> str:
        """The same change found again (the next run of the detection) is the same event."""
        text = "|".join((self.node, self.device, self.workload, self.precision, self.optimization))
        return hashlib.sha256(f"drift|{text}|{self.run_id}".encode()).hexdigest()[:32]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"at": self.at.isoformat(), "event_id": self.event_id}


@dataclass(frozen=True, slots=True)
class Outlier:
    node: str
    device: str
    device_label: str
    device_model: str | None
    stack_id: str | None
    workload: str
    precision: str
    optimization: str
    value: float
    peer_median: float
    ratio: float
    peers: int
    outlier: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_history(
    engine: Engine, *, node: str | None = None, history: int = 500
) -> dict[SeriesKey, list[Result]]:
    """The last ``history`` analysed solo results of every series (of one node, or all), oldest
    first."""
    columns = (
        ProbeRunRecord.node,
        ProbeRunRecord.device,
        ProbeRunRecord.workload,
        ProbeRunRecord.precision,
        ProbeRunRecord.optimization,
        ProbeRunRecord.run_id,
        ProbeRunRecord.ended_at,
        ProbeRunRecord.steady_throughput,
        ProbeRunRecord.stack_id,
        ProbeRunRecord.device_label,
        ProbeRunRecord.device_model,
        ProbeRunRecord.unit,
        ProbeRunRecord.steady_sm_clock_hertz,
        ProbeRunRecord.steady_temperature_celsius,
        ProbeRunRecord.steady_thermal_share,
        ProbeRunRecord.steady_power_share,
        ProbeRunRecord.id,
    )
    statement = select(*columns).where(
        ProbeRunRecord.outcome == "ok",
        ProbeRunRecord.steady_throughput.is_not(None),
        ProbeRunRecord.ended_at.is_not(None),
        ProbeRunRecord.scope == "device",
    )
    if node is not None:
        statement = statement.where(ProbeRunRecord.node == node)
    statement = statement.order_by(
        ProbeRunRecord.node,
        ProbeRunRecord.device,
        ProbeRunRecord.workload,
        ProbeRunRecord.precision,
        ProbeRunRecord.optimization,
        ProbeRunRecord.ended_at,
    )
    series: dict[SeriesKey, list[Result]] = {}
    try:
        with engine.connect() as connection:
            for row in connection.execute(statement):
                key = (row[0], row[1], row[2], row[3], row[4])
                series.setdefault(key, []).append(
                    Result(
                        run_id=row.run_id,
                        ended_at=row.ended_at,
                        steady=row.steady_throughput,
                        stack_id=row.stack_id,
                        device_label=row.device_label,
                        device_model=row.device_model,
                        unit=row.unit,
                        sm_clock_hertz=row.steady_sm_clock_hertz,
                        temperature_celsius=row.steady_temperature_celsius,
                        thermal_share=row.steady_thermal_share,
                        power_share=row.steady_power_share,
                        row_id=row.id,
                    )
                )
    except SQLAlchemyError as exc:
        raise archive_error("read probe results from", engine, exc) from exc
    return {key: results[-history:] for key, results in series.items()}


def stack_facts(engine: Engine, ids: Iterable[str | None]) -> dict[str, dict[str, Any]]:
    try:
        with engine.connect() as connection:
            return facts_by_id(connection, {i for i in ids if i})
    except SQLAlchemyError as exc:
        raise archive_error("read stacks from", engine, exc) from exc


def detect(
    history: dict[SeriesKey, list[Result]],
    stacks: dict[str, dict[str, Any]],
    *,
    window: int = 50,
    max_pvalue: float = 0.001,
    min_magnitude: float = 0.03,
) -> list[Drift]:
    """Every change point of every series, attributed; sorted by time."""
    found = []
    for key, results in history.items():
        values = [r.steady for r in results]
        points = change_points(
            values, window=window, max_pvalue=max_pvalue, min_magnitude=min_magnitude
        )
        bounds = [0, *(p.index for p in points), len(results)]
        for position, point in enumerate(points):
            before = results[bounds[position] : point.index]
            after = results[point.index : bounds[position + 2]]
            found.append(_drift(key, point.index, results, before, after, point, stacks))
    return sorted(found, key=lambda d: (d.at, d.node, d.device, d.workload, d.precision))


def _drift(  # noqa: PLR0917
    key: SeriesKey,
    index: int,
    results: Sequence[Result],
    before: Sequence[Result],
    after: Sequence[Result],
    point: Any,
    stacks: dict[str, dict[str, Any]],
) -> Drift:
    node, device, workload, precision, optimization = key
    first = results[index]
    stack_before = _mode(r.stack_id for r in before)
    stack_after = _mode(r.stack_id for r in after)
    cause, explanation = _attribute(before, after, stack_before, stack_after, point, stacks)
    return Drift(
        node=node,
        device=device,
        device_label=first.device_label,
        device_model=first.device_model,
        workload=workload,
        precision=precision,
        optimization=optimization,
        unit=first.unit,
        at=first.ended_at,
        run_id=first.run_id,
        before=float(point.mean_before),
        after=float(point.mean_after),
        change=float(point.relative_change),
        pvalue=float(point.pvalue),
        direction="regression" if point.relative_change < 0 else "improvement",
        cause=cause,
        explanation=explanation,
        stack_before=stack_before,
        stack_after=stack_after,
    )


def _attribute(  # noqa: PLR0917
    before: Sequence[Result],
    after: Sequence[Result],
    stack_before: str | None,
    stack_after: str | None,
    point: Any,
    stacks: dict[str, dict[str, Any]],
) -> tuple[str, str]:
    if stack_before != stack_after and stack_before is not None and stack_after is not None:
        old, new = stacks.get(stack_before), stacks.get(stack_after)
        if old is not None and new is not None:
            changes = diff(old, new)
            text = summary(changes) if changes else "stack ids differ, facts equal"
        else:
            text = "facts of one side not in the archive"
        return "stack", f"stack {stack_before[:12]} -> {stack_after[:12]}: {text}"
    thermal = _step(before, after, "thermal_share")
    power = _step(before, after, "power_share")
    temperature = _step(before, after, "temperature_celsius")
    clock = _step(before, after, "sm_clock_hertz")
    clock_ratio = _ratio(before, after, "sm_clock_hertz")
    clock_text = (
        ""
        if clock_ratio is None
        else f"SM clock {_mean(before, 'sm_clock_hertz') / 1e9:.3g} GHz -> "
        f"{_mean(after, 'sm_clock_hertz') / 1e9:.3g} GHz"
    )
    hotter = temperature is not None and temperature >= TEMPERATURE_STEP
    slower_clock = clock is not None and clock < 0
    if (thermal is not None and thermal >= THERMAL_SHARE_STEP) or (hotter and slower_clock):
        parts = [clock_text] if clock_text else []
        if thermal is not None:
            parts.append(
                f"thermal throttling {_mean(before, 'thermal_share'):.0%} -> "
                f"{_mean(after, 'thermal_share'):.0%} of the steady state"
            )
        if temperature is not None:
            parts.append(
                f"{_mean(before, 'temperature_celsius'):.0f} -> "
                f"{_mean(after, 'temperature_celsius'):.0f} °C"
            )
        return "thermal", ", ".join(parts)
    if power is not None and power >= THERMAL_SHARE_STEP:
        text = (
            f"power throttling {_mean(before, 'power_share'):.0%} -> "
            f"{_mean(after, 'power_share'):.0%} of the steady state"
        )
        return "power", ", ".join(p for p in (clock_text, text) if p)
    change = float(point.relative_change)
    if clock_ratio is not None and abs(clock_ratio - 1) >= abs(change) / 2:
        return "clocks", f"{clock_text}, no throttle reason reported"
    return "unexplained", "same stack, no clock, thermal or power change seen"


def _values(results: Sequence[Result], name: str) -> list[float]:
    return [v for v in (getattr(r, name) for r in results) if v is not None]


def _mean(results: Sequence[Result], name: str) -> float:
    values = _values(results, name)
    return statistics.fmean(values) if values else 0.0


def _step(before: Sequence[Result], after: Sequence[Result], name: str) -> float | None:
    a, b = _values(before, name), _values(after, name)
    if not a or not b:
        return None
    return statistics.fmean(b) - statistics.fmean(a)


def _ratio(before: Sequence[Result], after: Sequence[Result], name: str) -> float | None:
    a, b = _values(before, name), _values(after, name)
    if not a or not b or statistics.fmean(a) == 0:
        return None
    return statistics.fmean(b) / statistics.fmean(a)


def _mode(values: Iterable[str | None]) -> str | None:
    counts = Counter(v for v in values if v is not None)
    return counts.most_common(1)[0][0] if counts else None


def fleet_outliers(
    history: dict[SeriesKey, list[Result]], ratio: float = 0.10, node: str | None = None
) -> list[Outlier]:
    """Each device against the median of identical devices (model, stack, probe); ``node``
    limits the answer (not the peers) to one node's devices."""
    groups: dict[tuple[Any, ...], list[tuple[SeriesKey, Result, float]]] = {}
    for key, results in history.items():
        recent = results[-RECENT:]
        if not recent:
            continue
        last = recent[-1]
        value = statistics.median(r.steady for r in recent)
        group = (last.device_model, last.stack_id, key[2], key[3], key[4])
        groups.setdefault(group, []).append((key, last, value))
    found = []
    for members in groups.values():
        if len(members) < MIN_PEERS:
            continue
        for key, last, value in members:
            if node is not None and key[0] != node:
                continue
            peers = [v for k, _, v in members if k != key]
            found.append(_outlier(key, last, value, statistics.median(peers), len(peers), ratio))
    return sorted(found, key=lambda o: (o.ratio, o.node, o.device, o.workload))


def outliers_by_key(
    engine: Engine, own: dict[SeriesKey, list[Result]], ratio: float = 0.10
) -> list[Outlier]:
    """``fleet_outliers(history, ratio, node)`` for one node's series ``own``, from the fleet's
    baselines (agent.archive.fleet_baselines, PostgreSQL): a row per group of the node's own
    devices, never the peers' results. Where a series was in its group at the baselines' pass
    (its results the pass saw), its value then is the one left out of the median."""
    latest: dict[SeriesKey, tuple[fleet_baselines.GroupKey, list[Result]]] = {}
    for key, results in own.items():
        recent = results[-RECENT:]
        if recent:
            latest[key] = (_group_key(key, recent[-1]), recent)
    rows = fleet_baselines.groups(
        engine, fleet_baselines.OUTLIER, (group for group, _ in latest.values())
    )
    found = []
    for key, (group, recent) in latest.items():
        row = rows.get(group)
        if row is None:
            continue
        then = [r for r in own[key] if row.saw(r.ended_at, r.row_id)][-RECENT:]
        member = bool(then) and _group_key(key, then[-1]) == group
        members = row.members + (0 if member else 1)
        if members < MIN_PEERS:
            continue
        left_out = statistics.median(r.steady for r in then) if member else None
        median = row.steady.median(left_out) or 0.0
        value = statistics.median(r.steady for r in recent)
        found.append(_outlier(key, recent[-1], value, median, members - 1, ratio))
    return sorted(found, key=lambda o: (o.ratio, o.node, o.device, o.workload))


def _outlier(  # noqa: PLR0917
    key: SeriesKey, last: Result, value: float, median: float, peers: int, ratio: float
) -> Outlier:
    share = value / median if median else 1.0
    return Outlier(
        node=key[0],
        device=key[1],
        device_label=last.device_label,
        device_model=last.device_model,
        stack_id=last.stack_id,
        workload=key[2],
        precision=key[3],
        optimization=key[4],
        value=value,
        peer_median=median,
        ratio=share,
        peers=peers,
        outlier=share < 1 - ratio,
    )


def _group_key(key: SeriesKey, last: Result) -> fleet_baselines.GroupKey:
    return (key[2], key[3], key[4], "", last.device_model or "", last.stack_id or "")


def since_filter(drifts: Sequence[Drift], since: datetime | None) -> list[Drift]:
    return [d for d in drifts if since is None or d.at >= since]


def main() -> int:
    """``python -m agent.drift.detect``: the daemon's child. Request on stdin, answer on stdout."""
    request = json.load(sys.stdin)
    try:
        engine = open_engine(request["database_url"])
    except ArchiveError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        node = request["node"]
        by_key = fleet_baselines.present(engine)
        if by_key:
            # One node's own history, and a row per group of its devices: the fleet's pass is
            # made by one agent a period (whoever finds it due and takes the lock).
            fleet_baselines.refresh_if_due(
                engine,
                now=datetime.now(UTC),
                interval_seconds=request.get("interval_seconds", 3600.0),
                baseline_days=request.get("baseline_days", 7.0),
            )
            own = load_history(engine, node=node, history=request["history"])
        else:  # SQLite: one node's archive, its own fleet
            history = load_history(engine, history=request["history"])
            own = {key: results for key, results in history.items() if key[0] == node}
        drifts = detect(
            own,
            stack_facts(engine, (r.stack_id for results in own.values() for r in results)),
            window=request["window"],
            max_pvalue=request["max_pvalue"],
            min_magnitude=request["min_magnitude"],
        )
        if by_key:
            outliers = outliers_by_key(engine, own, request["outlier_ratio"])
        else:
            outliers = fleet_outliers(history, request["outlier_ratio"], node=node)
    except ArchiveError as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        engine.dispose()
    json.dump(
        {
            "drifts": [d.as_dict() for d in drifts],
            "outliers": [o.as_dict() for o in outliers],
        },
        sys.stdout,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
