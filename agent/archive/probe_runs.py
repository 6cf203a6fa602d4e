"""Writing probe runs: a ``running`` row at the start, the outcome at the end.

Writing the start first is what lets the agent tell, after a kill -9, which run it never
finished: at the next start every ``running`` row of this node becomes ``aborted``. Both writes
are made as JSON payloads first (what the spool keeps) and applied idempotently: the start is
inserted unless the run is there, the end is an upsert on the run id, the series is inserted
unless it is there; so a payload replayed after an outage or a crash is stored once.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, and_, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import SQLAlchemyError

from agent.archive import partitions
from agent.archive.database import archive_error
from agent.archive.models import ProbeRunRecord, ProbeSeriesRecord
from agent.probes.analysis import RunAnalysis
from agent.probes.attribution import HW_SLOWDOWN, POWER_BRAKE, POWER_CAP, THERMAL_REASONS
from agent.probes.runner import ProbeRun, ProbeSpec
from agent.probes.scheduler import LATENCY_QUANTILES, RecordError
from agent.probes.status import ProbeKey, ProbeResult


def _time(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, UTC)


def _analysis_values(analysis: RunAnalysis | None) -> dict[str, Any]:
    if analysis is None:
        return {}
    figures = analysis.figures
    ci = figures.get("steady_ci") or (None, None)
    return {
        "classification": figures.get("classification"),
        "peak_throughput": figures.get("peak_throughput"),
        "steady_throughput": figures.get("steady_throughput"),
        "steady_ci_low": ci[0],
        "steady_ci_high": ci[1],
        "sustained_ratio": figures.get("sustained_ratio"),
        "steady_start_index": figures.get("steady_start_index"),
        "warmup_seconds": figures.get("warmup_seconds"),
        "p10_throughput": figures.get("p10_throughput"),
        "p50_throughput": figures.get("p50_throughput"),
        "cause": analysis.attribution.cause,
        **_steady_telemetry(analysis),
        "work_per_joule": analysis.attribution.work_per_joule,
        "analysis": json.dumps(analysis.as_dict(), sort_keys=True),
    }


def _steady_telemetry(analysis: RunAnalysis) -> dict[str, Any]:
    """The last segment's telemetry (the steady one when there is a steady state)."""
    segments = analysis.attribution.segments
    if not segments:
        return {}
    last = segments[-1]
    shares = last.reason_share
    return {
        "steady_sm_clock_hertz": last.sm_clock_hertz,
        "steady_temperature_celsius": last.temperature_celsius,
        "steady_power_watts": last.power_watts,
        "steady_thermal_share": _share(shares, (*THERMAL_REASONS, HW_SLOWDOWN)),
        "steady_power_share": _share(shares, (POWER_BRAKE, POWER_CAP)),
    }


def _size(spec: ProbeSpec, reported: Any = None) -> str:
    """The problem size the child ran: the one its manifest reports, else the one asked for (a
    spec without a size asks the workload for its default)."""
    return reported[:32] if isinstance(reported, str) else spec.size or "default"


def _share(shares: dict[str, float], reasons: tuple[str, ...]) -> float | None:
    """The largest share among ``reasons`` (they overlap in time, so they do not add up)."""
    found = [shares[reason] for reason in reasons if reason in shares]
    return max(found) if found else None


class ProbeRunWriter:
    """One node's probe runs: payloads for the spool, and their idempotent application."""

    def __init__(self, engine: Engine, node: str) -> None:
        self._engine = engine
        self.node = node
        self._insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert

    def _identity(self, run_id: str, spec: ProbeSpec) -> dict[str, Any]:
        return {
            "run_id": run_id,
            "node": self.node,
            "device": spec.device.key,
            "device_label": spec.device.label,
            "workload": spec.workload,
            "precision": spec.precision,
            "optimization": spec.optimization,
            "size": _size(spec),
            "scope": spec.scope,
        }

    def start_payload(self, run_id: str, spec: ProbeSpec, started_at: float) -> dict[str, Any]:
        return self._identity(run_id, spec) | {
            "outcome": "running",
            "reason": "",
            "started_at": started_at,
            "duration_seconds": 0.0,
            "iterations": 0,
            "stderr_tail": "",
        }

    def finish_payload(
        self,
        run: ProbeRun,
        *,
        analysis: RunAnalysis | None = None,
        stack_id: str | None = None,
        coupling: float | None = None,
    ) -> dict[str, Any]:
        """The whole row (identity included: a skipped run never had a start) and the series."""
        manifest = run.manifest or {}
        device_model = manifest.get("device_name")
        values = (
            self._identity(run.id, run.spec)
            | _analysis_values(analysis)
            | {
                "outcome": run.outcome,
                "reason": run.reason,
                "started_at": run.started_at,
                "ended_at": run.ended_at,
                "duration_seconds": run.ended_at - run.started_at,
                "iterations": len(run.iterations),
                "throughput": run.throughput,
                "unit": manifest.get("unit"),
                "size": _size(run.spec, manifest.get("size")),
                "exit_code": run.exit_code,
                "manifest": None if run.manifest is None else json.dumps(manifest, sort_keys=True),
                "result": None if run.result is None else json.dumps(run.result, sort_keys=True),
                "stderr_tail": run.stderr_tail,
                "stack_id": stack_id,
                "device_model": None if device_model is None else str(device_model)[:128],
                "group_id": run.group,
                "coupling_ratio": coupling,
            }
        )
        series = [[i.index, i.start, i.end, i.work, i.phase] for i in run.iterations]
        return {"run": values, "series": series}

    def apply(self, connection: Connection, kind: str, payload: dict[str, Any]) -> None:
        """Store a "probe_start" or "probe_finish" payload in ``connection``'s transaction."""
        # A run is found by its id alone. The unique key is the id with the start (the partition
        # key on PostgreSQL), but the start row holds the time the scheduler began the run and
        # the end the child's own start, so the end updates the row by id (moving it to its
        # month's partition if need be) and inserts only a run that never had a start.
        key = ["run_id", "started_at"]
        exists = select(ProbeRunRecord.id).where(ProbeRunRecord.run_id == payload.get("run_id"))
        if kind == "probe_start":
            values = _with_times(payload)
            if connection.execute(exists).first() is not None:
                return  # replayed after its end was written
            partitions.ensure_for(connection, "probe_runs", [values["started_at"]])
            connection.execute(
                self._insert(ProbeRunRecord)
                .values(values)
                .on_conflict_do_nothing(index_elements=key)
            )
            return
        values = _with_times(payload["run"])
        # The series first: the run's row fires the summary's trigger (agent.archive.summary),
        # whose row locks every finish of a model and day shares; they are then held only for
        # the run's update and the commit, not while the series (tens of KB) is sent.
        if payload["series"]:
            partitions.ensure_for(connection, "probe_series", [values["started_at"]])
            connection.execute(
                self._insert(ProbeSeriesRecord)
                .values(
                    run_id=values["run_id"],
                    started_at=values["started_at"],
                    iterations=json.dumps(payload["series"]),
                )
                .on_conflict_do_nothing(index_elements=key)
            )
        partitions.ensure_for(connection, "probe_runs", [values["started_at"]])
        changed = {name: value for name, value in values.items() if name != "run_id"}
        updated = connection.execute(
            update(ProbeRunRecord).where(ProbeRunRecord.run_id == values["run_id"]).values(changed)
        ).rowcount
        if not updated:
            connection.execute(
                self._insert(ProbeRunRecord)
                .values(values)
                .on_conflict_do_update(index_elements=key, set_=changed)
            )

    def start(self, run_id: str, spec: ProbeSpec, started_at: float) -> None:
        """Write the start now (no spool): for tools and tests."""
        self._apply("probe_start", self.start_payload(run_id, spec, started_at))

    def finish(
        self,
        run: ProbeRun,
        *,
        analysis: RunAnalysis | None = None,
        stack_id: str | None = None,
        coupling: float | None = None,
    ) -> None:
        """Write the end now (no spool): for tools and tests."""
        payload = self.finish_payload(run, analysis=analysis, stack_id=stack_id, coupling=coupling)
        self._apply("probe_finish", payload)

    def _apply(self, kind: str, payload: dict[str, Any]) -> None:
        try:
            with self._engine.begin() as connection:
                self.apply(connection, kind, payload)
        except SQLAlchemyError as exc:
            raise RecordError(
                str(archive_error("record a probe run in", self._engine, exc))
            ) from exc

    def abort_unfinished(self) -> int:
        """Mark this node's runs still ``running`` (the agent died during them) as aborted."""
        statement = (
            update(ProbeRunRecord)
            .where(ProbeRunRecord.node == self.node, ProbeRunRecord.outcome == "running")
            .values(outcome="aborted", reason="the agent stopped during the run")
        )
        try:
            with self._engine.begin() as connection:
                return connection.execute(statement).rowcount
        except SQLAlchemyError as exc:
            raise archive_error("mark aborted probe runs in", self._engine, exc) from exc


def latest_results(engine: Engine, node: str) -> list[tuple[ProbeKey, float, ProbeResult]]:
    """The latest analysed ok solo run of each probe of ``node`` (key, end time, result): what
    the probe gauges showed before a restart, restored from here at start-up (node-wide runs
    are not: their gauges wait for the next node-wide run)."""
    record = ProbeRunRecord
    identity = (
        record.workload,
        record.precision,
        record.optimization,
        record.device,
        record.device_label,
    )
    analysed = and_(
        record.node == node,
        record.outcome == "ok",
        record.analysis.is_not(None),
        record.scope == "device",
    )
    last = (
        select(*identity, func.max(record.ended_at).label("last"))
        .where(analysed)
        .group_by(*identity)
        .subquery()
    )
    statement = (
        select(
            *identity,
            record.ended_at,
            record.manifest,
            record.result,
            record.analysis,
            record.size,
        )
        .join(
            last,
            and_(
                *(column == last.c[column.key] for column in identity),
                record.ended_at == last.c.last,
            ),
        )
        .where(analysed)
    )
    try:
        with engine.connect() as connection:
            rows = connection.execute(statement).all()
    except SQLAlchemyError as exc:
        raise archive_error("read the latest probe results from", engine, exc) from exc
    restored = []
    for (
        workload,
        precision,
        optimization,
        device,
        label,
        ended_at,
        manifest,
        result,
        analysis,
        size,
    ) in rows:
        if ended_at is None or analysis is None:  # excluded by the query; for the type checker
            continue
        facts = json.loads(manifest) if manifest else {}
        latency = (json.loads(result) if result else {}).get("latency_seconds") or {}
        uuid = "" if device == "host" else device
        restored.append(
            (
                (workload, precision, optimization, label, uuid),
                ended_at.timestamp(),
                ProbeResult(
                    unit=str(facts.get("unit", "")),
                    work_unit=str(facts.get("work_unit", "")),
                    analysis=RunAnalysis.from_dict(json.loads(analysis)),
                    latency_seconds={
                        name: float(value)
                        for name, value in latency.items()
                        if name in LATENCY_QUANTILES and isinstance(value, int | float)
                    },
                    # As the plan asked for it: "default/4" is the default, fitted.
                    size=(size or "default").split("/")[0],
                ),
            )
        )
    return restored


def _with_times(values: dict[str, Any]) -> dict[str, Any]:
    """Payload timestamps (Unix seconds, as JSON keeps them) as the aware datetimes of the model."""
    return {
        name: _time(value) if name in ("started_at", "ended_at") and value is not None else value
        for name, value in values.items()
    }
