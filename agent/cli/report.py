"""`sustain report run RUN_ID` and `sustain report fleet`, and the plots of `sustain probe --plot`
and `sustain analyze --plot`: pictures for people (docs/report.md).

matplotlib (``sustain[report]``) is imported only here, when a picture is drawn; without it the
command says how to install it in one line, exit 2, before any probe runs.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.plots.canvas import PlotError, PlotsUnavailable, check_available, check_path
from workloads.progress import working

if TYPE_CHECKING:
    from agent.analysis.result import SteadyStateResult
    from agent.config.settings import Settings
    from agent.probes.analysis import RunAnalysis
    from agent.probes.runner import ProbeRun

DEFAULT_FLEET_OUTPUT = Path("report.html")


class ReportError(Exception):
    """A report or plot that cannot be made; one line."""


def check_plots(path: Path | None = None) -> None:
    """Fail now (matplotlib missing, an unknown picture format) rather than after the work."""
    try:
        check_available()
        if path is not None:
            check_path(path)
    except (PlotsUnavailable, PlotError) as exc:
        raise ReportError(str(exc)) from None


def add_arguments(report: argparse.ArgumentParser, config_flags: Callable[[Any], None]) -> None:
    actions = report.add_subparsers(dest="report_command", required=True, metavar="ACTION")
    run = actions.add_parser(
        "run",
        help="one archived run as a picture: throughput, change points, steady band, telemetry",
    )
    config_flags(run)
    run.add_argument("run_id", metavar="RUN_ID", help="the run's id, or its first characters")
    run.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="FILE",
        help="SVG or PNG, by the extension (default: run-<RUN_ID>.svg here)",
    )
    fleet = actions.add_parser(
        "fleet", help="the planner's report: one self-contained HTML file from the archive"
    )
    config_flags(fleet)
    fleet.add_argument(
        "--since",
        default="30d",
        help="results from then on: 30d, 24h or an ISO date (default: %(default)s; 'all' for "
        "every result)",
    )
    fleet.add_argument(
        "-o",
        "--output",
        type=Path,
        default=DEFAULT_FLEET_OUTPUT,
        metavar="FILE",
        help="the HTML file to write (default: %(default)s)",
    )


def run(args: argparse.Namespace, open_archive: Callable[[], Any], settings: Settings) -> int:
    """The `report` command: draw or write, then say where."""
    from agent.archive.database import ArchiveError

    output: Path | None = args.output
    if args.report_command == "run":
        check_plots(output)
    else:
        check_plots()
        since = _since(args.since)
    engine = open_archive()
    try:
        if args.report_command == "run":
            with working("drawing the run"):
                written = _run_plot(engine, args.run_id, output)
        else:
            with working("reading the archive and drawing the report"):
                written = _fleet(engine, since, args.output, settings)
    except ArchiveError as exc:
        raise ReportError(str(exc)) from None
    finally:
        engine.dispose()
    print(written)
    return 0


def _since(text: str) -> datetime | None:
    from agent.reports.capacity import parse_since

    if text.strip().lower() == "all":
        return None
    try:
        return parse_since(text, datetime.now(UTC))
    except ValueError as exc:
        raise ReportError(str(exc)) from None


def _run_plot(engine: Any, run_id: str, output: Path | None) -> Path:
    from agent.plots.run_figure import draw
    from agent.plots.run_sources import archived_plot
    from agent.reports.runs import RunNotFound, load_run

    try:
        run = load_run(engine, run_id)
    except RunNotFound as exc:
        raise ReportError(str(exc)) from None
    if not run.iterations:
        raise ReportError(f"run {run.run_id}: {run.outcome}, with no iterations to draw")
    path = output or Path(f"run-{run.run_id[:12]}.svg")
    _save(draw(archived_plot(run)), path)
    return path


def _fleet(engine: Any, since: datetime | None, output: Path, settings: Settings) -> Path:
    from agent.drift import detect
    from agent.plots.fleet_page import render
    from agent.reports.fleet import gather

    data = gather(engine, since, datetime.now(UTC))
    history = detect.load_history(engine, history=settings.drift.history)
    outliers = [
        o for o in detect.fleet_outliers(history, settings.drift.outlier_ratio) if o.outlier
    ]
    page = render(data, outliers, settings.drift.outlier_ratio)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise ReportError(f"{output}: cannot write: {exc.strerror or exc}") from None
    return output


def _save(figure: Any, path: Path) -> None:
    from agent.plots.canvas import save

    try:
        save(figure, path)
    except PlotError as exc:
        raise ReportError(str(exc)) from None


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def plot_probe_runs(
    results: Sequence[tuple[ProbeRun, RunAnalysis | None]], directory: Path
) -> list[Path]:
    """`sustain probe --plot DIR`: one SVG per run with iterations, named for what it ran."""
    from agent.plots.run_figure import draw
    from agent.plots.run_sources import probe_plot

    written = []
    for run, analysis in results:
        if not run.iterations:
            continue
        spec = run.spec
        name = "-".join(
            (spec.workload, spec.precision, spec.optimization, spec.device.title, spec.scope)
        )
        path = directory / f"{_UNSAFE.sub('_', name)}-{run.id[:8]}.svg"
        _save(draw(probe_plot(run, analysis)), path)
        written.append(path)
    return written


def plot_series(
    path: Path, title: str, values: Sequence[float], kind: str, result: SteadyStateResult
) -> None:
    """`sustain analyze FILE --plot OUT`: the series alone (a file carries no telemetry)."""
    from agent.plots.run_figure import draw
    from agent.plots.run_sources import series_plot

    _save(draw(series_plot(title, values, kind, result)), path)


def say_written(paths: Sequence[Path]) -> None:
    for path in paths:
        print(f"plot: {path}", file=sys.stderr)
