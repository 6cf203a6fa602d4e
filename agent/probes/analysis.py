"""Steady state versus peak of a finished probe run, and why: the daemon's side.

The steady-state analysis runs in a short-lived child (``python -m agent.analysis``), as the
workloads do, because numpy and scipy would take the daemon past its memory budget; the
attribution from the captured telemetry is plain Python and runs here.
"""

from __future__ import annotations

import json
import logging
import subprocess
from dataclasses import dataclass
from typing import Any

from agent.probes.attribution import Attribution, attribute
from agent.probes.runner import ProbeRun

log = logging.getLogger(__name__)

ANALYSIS_TIMEOUT_SECONDS = 120.0


@dataclass(frozen=True, slots=True)
class RunAnalysis:
    """The figures of one run (the child's JSON) and the attribution of its slowdown."""

    figures: dict[str, Any]
    attribution: Attribution

    def as_dict(self) -> dict[str, Any]:
        return {**self.figures, "attribution": self.attribution.as_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunAnalysis:
        """The inverse of ``as_dict``: an analysis as the archive keeps it."""
        figures = {name: value for name, value in data.items() if name != "attribution"}
        return cls(figures, Attribution.from_dict(data.get("attribution") or {}))


class AnalysisError(Exception):
    """The analysis child failed; the message is one line."""


def analyze_run(run: ProbeRun, python: str, tolerance: float) -> RunAnalysis:
    request = {
        "iterations": [[i.start, i.end, i.work, i.phase] for i in run.iterations],
        "tolerance": tolerance,
    }
    try:
        completed = subprocess.run(
            [python, "-m", "agent.analysis"],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=ANALYSIS_TIMEOUT_SECONDS,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AnalysisError(f"analysis did not run: {exc}") from None
    if completed.returncode != 0:
        lines = completed.stderr.strip().splitlines() or ["no error output"]
        raise AnalysisError(f"analysis exited {completed.returncode}: {lines[-1]}")
    figures: dict[str, Any] = json.loads(completed.stdout)
    attribution = attribute(
        run.telemetry,
        run.spec.device.gpu,
        [(i.start, i.end, i.work) for i in run.iterations],
        figures.get("changepoints") or [],
        str(figures.get("classification")),
        figures.get("steady_start_index"),
    )
    return RunAnalysis(figures, attribution)
