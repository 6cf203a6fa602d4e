"""One archived probe run read back whole: its row, its iterations and its analysis, for
``sustain report run RUN_ID`` (a prefix of the id does, as for stacks)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from agent.archive.database import archive_error
from agent.archive.models import ProbeRunRecord, ProbeSeriesRecord

MIN_PREFIX = 4


class RunNotFound(Exception):
    """No run, or several, with that id or prefix; the message is one line."""


@dataclass(frozen=True, slots=True)
class ArchivedRun:
    run_id: str
    node: str
    device: str
    device_label: str
    device_model: str | None
    workload: str
    precision: str
    optimization: str
    scope: str
    outcome: str
    unit: str
    started_at: datetime
    iterations: tuple[tuple[float, float, float, str | None], ...]
    analysis: dict[str, Any] | None

    @property
    def title(self) -> str:
        where = f"{self.node} {self.device_label}"
        if self.device_model:
            where += f" ({self.device_model})"
        if self.scope != "device":
            where += f", {self.scope}"
        return (
            f"{self.workload} {self.precision} {self.optimization} on {where}, "
            f"{self.started_at:%Y-%m-%d %H:%M:%S}Z, run {self.run_id[:12]}"
        )


def load_run(engine: Engine, run_id: str) -> ArchivedRun:
    """The run whose id is ``run_id`` or starts with it (at least MIN_PREFIX characters).

    Raises RunNotFound, or ArchiveError when the database cannot be read."""
    wanted = run_id.strip().lower()
    if len(wanted) < MIN_PREFIX or not all(c in "0123456789abcdef" for c in wanted):
        raise RunNotFound(f"run id {run_id!r}: give at least {MIN_PREFIX} hex digits of it")
    record = ProbeRunRecord
    try:
        with Session(engine) as session:
            rows = session.scalars(
                select(record).where(record.run_id.startswith(wanted, autoescape=True)).limit(2)
            ).all()
            if len(rows) != 1:
                found = "no run" if not rows else "several runs"
                raise RunNotFound(f"{found} with id {run_id!r} in the archive")
            row = rows[0]
            series = session.scalar(
                select(ProbeSeriesRecord.iterations).where(ProbeSeriesRecord.run_id == row.run_id)
            )
    except SQLAlchemyError as exc:
        raise archive_error("read a probe run from", engine, exc) from exc
    iterations = tuple(
        (float(item[1]), float(item[2]), float(item[3]), None if item[4] is None else str(item[4]))
        for item in (json.loads(series) if series else [])
    )
    return ArchivedRun(
        run_id=row.run_id,
        node=row.node,
        device=row.device,
        device_label=row.device_label,
        device_model=row.device_model,
        workload=row.workload,
        precision=row.precision,
        optimization=row.optimization,
        scope=row.scope,
        outcome=row.outcome,
        unit=row.unit or "",
        started_at=row.started_at,
        iterations=iterations,
        analysis=None if row.analysis is None else json.loads(row.analysis),
    )


@dataclass(frozen=True, slots=True)
class RunLine:
    """One run as ``sustain runs`` lists it: the id ``sustain report run`` takes, where and
    what it ran, its outcome and its headline figure (steady throughput, else the p10 of a run
    with no steady state) or why it has none."""

    run_id: str
    started_at: datetime
    node: str
    device_label: str
    device: str
    workload: str
    precision: str
    optimization: str
    scope: str
    outcome: str
    reason: str
    unit: str
    steady_throughput: float | None
    p10_throughput: float | None


@dataclass(frozen=True, slots=True)
class RunFilter:
    """Each one set narrows the list (device: its label, "0" or "cpu", or its UUID)."""

    workload: str | None = None
    precision: str | None = None
    device: str | None = None
    node: str | None = None
    outcome: str | None = None
    since: datetime | None = None


def recent_runs(engine: Engine, where: RunFilter, limit: int) -> list[RunLine]:
    """The ``limit`` latest runs that match ``where``, newest first. ArchiveError when the
    database cannot be read."""
    record = ProbeRunRecord
    query = select(
        record.run_id,
        record.started_at,
        record.node,
        record.device_label,
        record.device,
        record.workload,
        record.precision,
        record.optimization,
        record.scope,
        record.outcome,
        record.reason,
        record.unit,
        record.steady_throughput,
        record.p10_throughput,
    )
    for column, value in (
        (record.workload, where.workload),
        (record.precision, where.precision),
        (record.node, where.node),
        (record.outcome, where.outcome),
    ):
        if value is not None:
            query = query.where(column == value)
    if where.device is not None:
        query = query.where((record.device_label == where.device) | (record.device == where.device))
    if where.since is not None:
        query = query.where(record.started_at >= where.since)
    query = query.order_by(record.started_at.desc(), record.id.desc()).limit(limit)
    try:
        with engine.connect() as connection:
            rows = connection.execute(query).all()
    except SQLAlchemyError as exc:
        raise archive_error("read the probe runs from", engine, exc) from exc
    return [RunLine(**{**row._asdict(), "unit": row.unit or ""}) for row in rows]
