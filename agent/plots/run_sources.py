"""A ``RunPlot`` from each place a run comes from: one that just ran (``sustain probe --plot``),
one in the archive (``sustain report run``) and a series file (``sustain analyze --plot``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from agent.analysis.result import SteadyStateResult
from agent.analysis.trace import RunTrace, run_trace
from agent.plots.run_series import IterationRow, RunPlot, build, sample_panels, segment_panels
from agent.probes.analysis import RunAnalysis
from agent.probes.runner import ProbeRun
from agent.reports.runs import ArchivedRun


def probe_plot(run: ProbeRun, analysis: RunAnalysis | None) -> RunPlot:
    """A run with its 10 Hz telemetry; without an analysis, the series alone."""
    spec = run.spec
    rows: list[IterationRow] = [(i.start, i.end, i.work, i.phase) for i in run.iterations]
    figures = {} if analysis is None else analysis.figures
    trace = run_trace(rows, figures.get("phase"))
    where = spec.device.title if spec.device.kind == "cuda" else "the CPU"
    scope = "" if spec.scope == "device" else f" ({spec.scope})"
    title = (
        f"{spec.workload} {spec.precision} {spec.optimization} on {where}{scope}: {run.outcome}"
        f", run {run.id[:12]}"
    )
    unit = str((run.manifest or {}).get("unit", "work/s"))
    plot = build(title, unit, rows, figures, trace)
    if not rows:
        return plot
    panels, reasons, note = sample_panels(run.telemetry, spec.device.gpu, rows[0][0], rows[-1][1])
    return replace(
        plot,
        panels=panels,
        reasons=reasons,
        reasons_note=note,
        reasons_panel=spec.device.kind == "cuda",
        note=_phase(trace),
    )


def archived_plot(run: ArchivedRun) -> RunPlot:
    """An archived run; its panels are the segment means of its attribution."""
    figures = dict(run.analysis or {})
    trace = run_trace(run.iterations, figures.get("phase"))
    plot = build(run.title, run.unit or "work/s", run.iterations, figures, trace)
    segments = (figures.get("attribution") or {}).get("segments") or []
    if not run.iterations or not segments:
        note = "no telemetry: the run was not analysed" if not segments else ""
        return replace(plot, note=note)
    panels, reasons, reasons_note = segment_panels(segments, run.device, run.iterations[0][0])
    note = "telemetry: the mean of each segment (the archive keeps no samples)"
    if trace.phase is not None:
        note += f"; {_phase(trace)}"
    return replace(
        plot,
        panels=panels,
        reasons=reasons,
        reasons_note=reasons_note,
        reasons_panel=run.device != "host",
        note=note,
    )


def series_plot(
    title: str, values: Sequence[float], kind: str, result: SteadyStateResult
) -> RunPlot:
    """A series file: durations back to back in time, or throughputs one per second of nominal
    time (a throughput series says nothing of when)."""
    rows: list[IterationRow] = []
    clock = 0.0
    for value in values:
        seconds = value if kind == "duration" else 1.0
        work = 1.0 if kind == "duration" else value
        rows.append((clock, clock + seconds, work, None))
        clock += seconds
    unit = "iterations/s" if kind == "duration" else "work/s"
    plot = build(title, unit, rows, result.as_dict(), run_trace(rows))
    if kind == "throughput":
        plot = replace(plot, note="a throughput series has no times: one iteration a second")
    return plot


def _phase(trace: RunTrace) -> str:
    return "" if trace.phase is None else f"phase {trace.phase} (the one analysed)"
