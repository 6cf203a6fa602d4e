"""Writing probe runs: a ``running`` row at the start, the outcome at the end.

Writing the start first is what lets the agent tell, after a kill -9, which run it never
finished: at the next start every ``running`` row of this node becomes ``aborted``.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, insert, update
from sqlalchemy.exc import SQLAlchemyError

from agent.archive.database import archive_error
from agent.archive.models import ProbeRunRecord, ProbeSeriesRecord
from agent.probe_analysis import RunAnalysis
from agent.probes import ProbeRun, ProbeSpec


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
        "cause": analysis.attribution.cause,
        "work_per_joule": analysis.attribution.work_per_joule,
        "analysis": json.dumps(analysis.as_dict(), sort_keys=True),
    }


class ProbeRunWriter:
    def __init__(self, engine: Engine, node: str) -> None:
        self._engine = engine
        self.node = node

    def _identity(self, run_id: str, spec: ProbeSpec) -> dict[str, Any]:
        return {
            "run_id": run_id,
            "node": self.node,
            "device": spec.device.key,
            "device_label": spec.device.label,
            "workload": spec.workload,
            "precision": spec.precision,
            "optimization": spec.optimization,
        }

    def start(self, run_id: str, spec: ProbeSpec, started_at: float) -> None:
        values = self._identity(run_id, spec) | {
            "outcome": "running",
            "reason": "",
            "started_at": _time(started_at),
            "duration_seconds": 0.0,
            "iterations": 0,
            "stderr_tail": "",
        }
        self._execute("record the start of a probe in", insert(ProbeRunRecord).values(values))

    def finish(
        self, run: ProbeRun, *, started: bool = True, analysis: RunAnalysis | None = None
    ) -> None:
        """Complete the run's row (insert it whole for a run that never started: skipped)."""
        manifest = run.manifest or {}
        values = _analysis_values(analysis) | {
            "outcome": run.outcome,
            "reason": run.reason,
            "started_at": _time(run.started_at),
            "ended_at": _time(run.ended_at),
            "duration_seconds": run.ended_at - run.started_at,
            "iterations": len(run.iterations),
            "throughput": run.throughput,
            "unit": manifest.get("unit"),
            "exit_code": run.exit_code,
            "manifest": None if run.manifest is None else json.dumps(run.manifest, sort_keys=True),
            "result": None if run.result is None else json.dumps(run.result, sort_keys=True),
            "stderr_tail": run.stderr_tail,
        }
        series = json.dumps([[i.index, i.start, i.end, i.work, i.phase] for i in run.iterations])
        try:
            with self._engine.begin() as connection:
                if started:
                    connection.execute(
                        update(ProbeRunRecord).where(ProbeRunRecord.run_id == run.id).values(values)
                    )
                else:
                    connection.execute(
                        insert(ProbeRunRecord).values(self._identity(run.id, run.spec) | values)
                    )
                if run.iterations:
                    connection.execute(
                        insert(ProbeSeriesRecord).values(run_id=run.id, iterations=series)
                    )
        except SQLAlchemyError as exc:
            raise archive_error("record a probe run in", self._engine, exc) from exc

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

    def _execute(self, action: str, statement: Any) -> None:
        try:
            with self._engine.begin() as connection:
                connection.execute(statement)
        except SQLAlchemyError as exc:
            raise archive_error(action, self._engine, exc) from exc
