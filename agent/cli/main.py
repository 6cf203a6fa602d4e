"""The ``sustain`` command line.

Known errors (bad configuration, bad arguments, a database or port that cannot be used) end as one
line on standard error and exit code 2; tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from agent import __version__
from agent.cli.pipes import closed_pipe
from agent.cli.runs_command import add_runs_command
from agent.config.names import OPTIMIZATIONS

if TYPE_CHECKING:  # imported where used: `sustain analyze` needs neither pydantic nor SQLAlchemy
    from agent.config import settings as config

EXIT_OK = 0
EXIT_USAGE = 2


class UsageError(Exception):
    """A problem with what the user asked for; printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=os.environ.get("SUSTAIN_CONFIG"),
        help="TOML configuration file (default: $SUSTAIN_CONFIG, else embedded defaults)",
    )
    parser.add_argument(
        "--database",
        metavar="URL",
        help="archive database URL, SQLAlchemy's form (default: from the configuration, "
        "archive.database_url; unset: sustain.db in the data directory)",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        help="directory for the embedded SQLite archive (default: from the configuration, "
        "agent.data_dir)",
    )


# The flag behind each setting a flag can give, for problem lines ("--listen: ...").
_FLAG_NAMES = {
    ("archive", "database_url"): "--database",
    ("agent", "data_dir"): "--data-dir",
    ("exporter", "listen"): "--listen",
    ("agent", "log_level"): "--log-level",
}


def _settings(args: argparse.Namespace) -> config.Settings:
    from agent.config import settings as config

    overrides: dict[str, dict[str, Any]] = {}
    if getattr(args, "database", None):
        overrides.setdefault("archive", {})["database_url"] = args.database
    if getattr(args, "data_dir", None):
        overrides.setdefault("agent", {})["data_dir"] = args.data_dir
    if getattr(args, "listen", None):
        overrides.setdefault("exporter", {})["listen"] = args.listen
    if getattr(args, "log_level", None):
        overrides.setdefault("agent", {})["log_level"] = args.log_level
    return config.load(args.config, overrides, flag_names=_FLAG_NAMES)


def _without_none(value: Any) -> Any:
    """TOML has no null: unset keys are left out of `config show`."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


def cmd_run(args: argparse.Namespace) -> int:
    from agent import daemon  # the daemon's imports are only paid for by `run`
    from agent.log_escape import EscapingFormatter

    settings = _settings(args)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(EscapingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=settings.agent.log_level.upper(), handlers=[handler])
    # The scheduler logs every job run at INFO, and Alembic its internals: keep the log readable.
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    try:
        return daemon.run(settings)
    except daemon.StartupError as exc:
        raise UsageError(str(exc)) from None


def cmd_config_check(args: argparse.Namespace) -> int:
    from agent.config import settings as config

    problems = config.check_file(args.file) + config.check_environment()
    if problems:
        for problem in problems:
            print(problem)
        return EXIT_USAGE
    print("ok")
    return EXIT_OK


def cmd_config_show(args: argparse.Namespace) -> int:
    import tomli_w

    from agent.config import settings as config

    print(tomli_w.dumps(_without_none(config.redacted(_settings(args)))), end="")
    return EXIT_OK


def _open_archive(args: argparse.Namespace, *, write: bool = False) -> Any:
    """The archive engine: created if missing for ``write``, else an existing one, read-only."""
    from agent.archive.database import ArchiveError, open_archive, open_engine

    settings = _settings(args)
    try:
        return (open_engine if write else open_archive)(settings.database_url)
    except ArchiveError as exc:
        raise UsageError(str(exc)) from None


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from agent.archive.database import ArchiveError, current_revision, upgrade

    engine = _open_archive(args, write=True)
    try:
        upgrade(engine, args.revision)
        print(f"database at revision {current_revision(engine)}")
    except ArchiveError as exc:
        raise UsageError(str(exc)) from None
    finally:
        engine.dispose()
    return EXIT_OK


def cmd_db_current(args: argparse.Namespace) -> int:
    from agent.archive.database import ArchiveError, current_revision

    engine = _open_archive(args)
    try:
        print(current_revision(engine))
    except ArchiveError as exc:
        raise UsageError(str(exc)) from None
    finally:
        engine.dispose()
    return EXIT_OK


def _check_probe_names(args: argparse.Namespace, settings: config.Settings) -> None:
    """The names `sustain probe` is given, checked before its machinery is imported and any
    child starts: a misspelt one is one line at once, with the nearest known name. A precision
    or level needs one of the chosen workloads (default: the plan's) to declare it."""
    from agent.config import names

    workloads = args.workload or [entry.workload for entry in settings.probing.plan]
    checks: list[tuple[str, list[str] | None, Callable[[str], None]]] = [
        ("--workload", args.workload, names.check_workload),
        ("--precision", args.precision, lambda name: names.check_precision(name, workloads)),
        (
            "--optimization",
            args.optimization,
            lambda name: names.check_optimization(name, workloads),
        ),
    ]
    for flag, given, check in checks:
        for name in given or []:
            try:
                check(name)
            except names.UnknownName as exc:
                raise UsageError(f"{flag}: {exc}") from None


def cmd_probe(args: argparse.Namespace) -> int:
    settings = _settings(args)
    _check_probe_names(args, settings)
    if args.node and args.device is not None:
        raise UsageError("--node runs on every device of the node: leave out --device")

    from agent.archive.database import ArchiveError
    from agent.cli import probe as probe_command
    from agent.cli.report import ReportError, check_plots

    if args.plot is not None:
        try:
            check_plots()  # matplotlib is there, before any probe runs
        except ReportError as exc:
            raise UsageError(str(exc)) from None
    request = probe_command.Request(
        workloads=args.workload or [],
        precisions=args.precision or [],
        optimizations=args.optimization or [],
        duration=args.duration,
        device=args.device,
        size=args.size,
        force=args.force,
        record=settings.probing.record if args.record is None else args.record,
        node=args.node,
        plot=args.plot,
    )
    try:
        return probe_command.run_probes(settings, request, as_json=args.json)
    except probe_command.ProbeUsageError as exc:
        raise UsageError(str(exc)) from None
    except (ArchiveError, ReportError) as exc:  # --record's archive, --plot's directory
        raise UsageError(str(exc)) from None


def cmd_analyze(args: argparse.Namespace) -> int:
    from agent.analysis import InvalidSeriesError
    from agent.analysis.input import SeriesInputError, analyze_file
    from agent.analysis.summary import render_summary

    if args.plot is not None:
        return _plot_analysis(args)
    try:
        path = None if args.file == "-" else Path(args.file)
        result = analyze_file(path, args.column, args.kind, args.tolerance)
    except (SeriesInputError, InvalidSeriesError) as exc:
        raise UsageError(str(exc)) from None
    unit = "iterations/s" if args.kind == "duration" else "work/s"
    print(result.to_json() if args.json else render_summary(result, unit))
    return EXIT_OK


def _plot_analysis(args: argparse.Namespace) -> int:
    """`analyze --plot`: the summary as without it, and the series drawn with its verdict."""
    from agent.analysis import InvalidSeriesError, analyze, analyze_durations
    from agent.analysis.input import SeriesInputError, read_series
    from agent.analysis.summary import render_summary
    from agent.cli.report import ReportError, check_plots, plot_series

    try:
        check_plots(args.plot)
        path = None if args.file == "-" else Path(args.file)
        values = read_series(path, args.column, args.kind)
        measure = analyze_durations if args.kind == "duration" else analyze
        result = measure(values, tolerance=args.tolerance)
        title = f"{args.file}" + (f", column {args.column}" if args.column else "")
        plot_series(args.plot, title, [float(v) for v in values], args.kind, result)
    except (SeriesInputError, InvalidSeriesError, ReportError) as exc:
        raise UsageError(str(exc)) from None
    unit = "iterations/s" if args.kind == "duration" else "work/s"
    print(result.to_json() if args.json else render_summary(result, unit))
    print(f"plot: {args.plot}", file=sys.stderr)
    return EXIT_OK


def _fleet(args: argparse.Namespace, action: Callable[[Any], str], archive: bool = True) -> int:
    """Run a read-only archive command: its text on stdout, a FleetUsageError as one line."""
    from agent.archive.database import ArchiveError
    from agent.cli import fleet as fleet_command
    from workloads.progress import working

    engine = _open_archive(args) if archive else None
    try:
        with working("reading the archive" if archive else "reading this machine's stack"):
            text = action(engine)
        fleet_command.emit(text)
    except (fleet_command.FleetUsageError, ArchiveError) as exc:
        raise UsageError(str(exc)) from None
    finally:
        if engine is not None:
            engine.dispose()
    return EXIT_OK


def cmd_stack_show(args: argparse.Namespace) -> int:
    from agent.cli.fleet import stack_show

    return _fleet(
        args, lambda engine: stack_show(engine, args.stack, args.json), archive=bool(args.stack)
    )


def cmd_stack_diff(args: argparse.Namespace) -> int:
    from agent.cli.fleet import stack_diff

    return _fleet(args, lambda engine: stack_diff(engine, args.a, args.b))


def cmd_stack_history(args: argparse.Namespace) -> int:
    from agent.cli.fleet import stack_history

    return _fleet(args, lambda engine: stack_history(engine, args.node, args.json))


def cmd_drift(args: argparse.Namespace) -> int:
    from agent.cli.fleet import drift_report

    drift = _settings(args).drift
    return _fleet(
        args,
        lambda engine: drift_report(
            engine,
            since_text=args.since,
            node=args.node,
            window=drift.window,
            max_pvalue=drift.max_pvalue,
            min_magnitude=drift.min_magnitude,
            history_size=drift.history,
            outlier_ratio=drift.outlier_ratio,
            as_json=args.json,
        ),
    )


def cmd_runs(args: argparse.Namespace) -> int:
    from agent.cli.fleet import runs_list, since
    from agent.reports.runs import RunFilter

    def where() -> RunFilter:  # inside _fleet: a bad --since is one line, exit 2
        return RunFilter(
            workload=args.workload,
            precision=args.precision,
            device=args.device,
            node=args.node,
            outcome=args.outcome,
            since=since(args.since),
        )

    return _fleet(args, lambda engine: runs_list(engine, where(), args.limit, args.json))


def cmd_capacity(args: argparse.Namespace) -> int:
    from agent.cli.fleet import capacity_report

    return _fleet(
        args,
        lambda engine: capacity_report(
            engine,
            by=args.by,
            precision=args.precision,
            workload=args.workload,
            optimization=args.optimization,
            size=args.size,
            scope=args.scope,
            since_text=args.since,
            as_json=args.json,
        ),
    )


def cmd_health(args: argparse.Namespace) -> int:
    from agent.archive.database import ArchiveError
    from agent.cli import health as health_command
    from agent.cli import health_flags

    settings = _settings(args)
    try:
        authorization = health_flags.authorization(args)
        context = health_flags.tls_context(args)
    except health_flags.AccessError as exc:
        raise UsageError(str(exc)) from None
    verdict = health_command.node_health(
        settings,
        lambda: _open_archive(args),
        metrics=args.metrics,
        use_live=not args.no_live,
        authorization=authorization,
        context=context,
    )
    if args.health_command == "clear":
        from agent.archive.events import EventWriter

        engines: list[Any] = []

        def writer() -> EventWriter:
            engines.append(_open_archive(args, write=True))
            return EventWriter(engines[0], settings.agent.node)

        try:
            message, code = health_command.clear(verdict, writer, args.device, args.reason, args.by)
        except (health_command.HealthError, ArchiveError) as exc:
            raise UsageError(str(exc)) from None
        finally:
            for engine in engines:
                engine.dispose()
        print(message)
        return code
    if args.json:
        print(health_command.as_json(verdict, args.max_length))
    elif args.summary:
        print(health_command.summary(verdict, args.max_length))
    else:
        print(health_command.render(verdict, args.max_length))
    return health_command.exit_code(verdict)


def _add_health_command(commands: Any) -> None:
    from agent.cli.health_flags import add_arguments

    health = commands.add_parser(
        "health",
        help="each device's health now: exit 0 healthy, 1 degraded or unhealthy, 2 unknown",
        description="The node's verdict: one line per device with its state and reasons. Asks "
        "the running agent's /metrics, else reads the archive. Exit 0: every device healthy; "
        "1: a device degraded or unhealthy; 2: unknown (node-problem-detector's convention).",
    )
    _add_config_flags(health)
    add_arguments(health)
    health.set_defaults(handler=cmd_health, health_command=None)
    actions = health.add_subparsers(dest="health_command", metavar="ACTION")
    clear = actions.add_parser(
        "clear",
        help="acknowledge a device's current reasons (recorded with who and why) until new "
        "evidence arrives",
    )
    clear.add_argument("device", metavar="DEVICE", help="device index, UUID, or cpu")
    clear.add_argument(
        "--reason", required=True, metavar="TEXT", help="why, recorded (required: no default)"
    )
    clear.add_argument("--by", metavar="NAME", help="who (default: $SUDO_USER, else the user)")
    _add_config_flags(clear)
    add_arguments(clear)


def cmd_report(args: argparse.Namespace) -> int:
    from agent.cli import report as report_command

    try:
        return report_command.run(args, lambda: _open_archive(args), _settings(args))
    except report_command.ReportError as exc:
        raise UsageError(str(exc)) from None


def _add_plot_flags(probe: argparse.ArgumentParser, analyze: argparse.ArgumentParser) -> None:
    probe.add_argument(
        "--plot",
        type=Path,
        metavar="DIR",
        help="draw each run as an SVG in DIR: throughput, change points, steady band and the "
        "device's telemetry (needs sustain[report]; off by default)",
    )
    analyze.add_argument(
        "--plot",
        type=Path,
        metavar="FILE",
        help="draw the series and its verdict, SVG or PNG by the extension (needs "
        "sustain[report]; off by default)",
    )


def _add_report_command(commands: Any) -> None:
    from agent.cli.report import add_arguments

    report = commands.add_parser(
        "report",
        help="pictures: one archived run (SVG/PNG), or the fleet as one HTML page",
        description="Run plots and the planner's report (docs/report.md); they need matplotlib: "
        "pip install 'sustain[report]'.",
    )
    add_arguments(report, _add_config_flags)
    report.set_defaults(handler=cmd_report)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"must be in (0, 3600] seconds: {text!r}")
    return value


CAPACITY_COLUMNS = """\
The table has a section per probe (workload, precision, optimization), headed by
the unit of its figures, and in it a line per group, problem size and scope.
Every ok run counts: one with a steady state on its steady throughput, one the
analysis found never settled on its p10 over one-second windows, in a section
of its own headed "p10 basis (no steady state)" (the two never mix):
  MODEL    the group: the device's model (--by model), its node (NODE) or its
           software stack's id, first 12 characters (STACK); "-" where the
           runs did not record it
  SIZE     the runs' problem size: "default" (chosen from the device), "small",
           or "default/4" (divided by 4 to fit the duration); sizes never mix
  SCOPE    solo: the device ran alone; node-wide: each device while every
           device of its node ran at once (what production sees: plan with
           it); node-total: the node's sum in those runs; scopes never mix
  MEDIAN   median of the runs' steady-state throughput (p10 basis: of their
           p10s), in the heading's unit with an SI prefix: 712.3 T in a
           FLOP/s section is 712.3e12 FLOP/s
  P10      10th percentile of the same: 9 results in 10 were at least this
  SPEC     MEDIAN over the model's published dense peak, in percent; "-" where
           the peak is unknown, the group mixes models or the row is a
           node-total (a node's sum: the peak is a device's)
  RESULTS  the runs behind the figures
  DEVICES  distinct devices (node and device) among those runs; for a
           node-total, the nodes
Under the table: the runs used, on each basis, and the runs of the same probes
and period left out, by why: failed, timeout, preempted, aborted, insufficient
(too short to judge), or ok without a figure.
Nothing is cut to fit the terminal (80 columns when there is none): a name too
long for its column stands on a line of its own, its figures on the next; where
not even the figures fit, each row is a block of one column a line, the figures
with their full unit.
--json gives one object: "rows", each with group, workload, precision,
optimization, size, scope (device, node or node_total), basis (steady or p10),
unit, median and p10 (in unit), results, devices, spec_ratio (0-1, or null);
and "runs": {"used": {"steady": N, "p10": N}, "left_out": {reason: N, ...}}.
"""


def _add_fleet_commands(commands: Any) -> None:
    """stack, drift and capacity: the commands that read the archive."""
    stack = commands.add_parser("stack", help="the software stack results are measured on")
    stack_commands = stack.add_subparsers(dest="stack_command", required=True, metavar="ACTION")
    show_stack = stack_commands.add_parser(
        "show", help="this machine's stack now, or a stored one by id (prefix)"
    )
    _add_config_flags(show_stack)
    show_stack.add_argument("stack", nargs="?", help="stack id or prefix (default: read it now)")
    show_stack.add_argument("--json", action="store_true", help="one JSON object (off by default)")
    show_stack.set_defaults(handler=cmd_stack_show)
    diff_stack = stack_commands.add_parser("diff", help="two stored stacks, field by field")
    _add_config_flags(diff_stack)
    diff_stack.add_argument("a", help="old stack id or prefix")
    diff_stack.add_argument("b", help="new stack id or prefix")
    diff_stack.set_defaults(handler=cmd_stack_diff)
    stack_history = stack_commands.add_parser("history", help="stack changes, oldest first")
    _add_config_flags(stack_history)
    stack_history.add_argument("--node", help="one node (default: every node in the archive)")
    stack_history.add_argument("--json", action="store_true", help="a JSON array (off by default)")
    stack_history.set_defaults(handler=cmd_stack_history)

    add_runs_command(commands, _add_config_flags, cmd_runs)
    drift = commands.add_parser(
        "drift", help="lasting changes in sustained throughput, their causes, fleet outliers"
    )
    _add_config_flags(drift)
    drift.add_argument(
        "--since",
        help="changes from then on: 7d, 24h, 30m or an ISO date/time (default: every change "
        "in the history)",
    )
    drift.add_argument(
        "--node",
        help="one node's devices; peers still come from every node (default: every node)",
    )
    drift.add_argument("--json", action="store_true", help="one JSON object (off by default)")
    drift.set_defaults(handler=cmd_drift)

    capacity = commands.add_parser(
        "capacity",
        help="sustained throughput per GPU model, node or stack (median, p10)",
        epilog=CAPACITY_COLUMNS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_flags(capacity)
    capacity.add_argument(
        "--by",
        choices=["model", "node", "stack"],
        default="model",
        help="group by the device's model, its node or its stack (default: %(default)s)",
    )
    capacity.add_argument("--precision", help="one precision, e.g. bf16 (default: every precision)")
    capacity.add_argument("--workload", help="one workload, e.g. matmul (default: every workload)")
    capacity.add_argument(
        "--optimization",
        choices=OPTIMIZATIONS,
        help="one optimization (default: every one, apart)",
    )
    capacity.add_argument(
        "--size",
        help="one problem size: default, small, default/4, ... (default: every size, apart)",
    )
    capacity.add_argument(
        "--scope",
        choices=["device", "node", "node_total"],
        help="device: solo runs; node: each device within node-wide runs; node_total: the "
        "node's sum (default: every scope, apart)",
    )
    capacity.add_argument(
        "--since",
        help="results from then on: 7d, 24h, 30m or an ISO date (default: every result)",
    )
    capacity.add_argument(
        "--json", action="store_true", help="a JSON array (off by default: a table)"
    )
    capacity.set_defaults(handler=cmd_capacity)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sustain", description="Sustained-throughput agent for GPU and CPU nodes."
    )
    parser.add_argument("--version", action="version", version=f"sustain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="run the agent until SIGTERM or SIGINT")
    _add_config_flags(run)
    run.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="exporter address (default: from the configuration, exporter.listen; "
        "0.0.0.0:9477 unless set)",
    )
    run.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help="what the log shows (default: from the configuration, agent.log_level; info "
        "unless set)",
    )
    run.set_defaults(handler=cmd_run)

    cfg = commands.add_parser("config", help="check or show the configuration")
    cfg_commands = cfg.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    check = cfg_commands.add_parser(
        "check",
        help="validate a TOML file, and the SUSTAIN_* environment: 'ok' or one line per problem",
    )
    check.add_argument("file", type=Path, help="the TOML file to validate")
    check.set_defaults(handler=cmd_config_check)
    show = cfg_commands.add_parser(
        "show", help="print the effective configuration, secrets redacted"
    )
    _add_config_flags(show)
    show.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="exporter address, as `run --listen` (default: from the configuration, "
        "exporter.listen)",
    )
    show.set_defaults(handler=cmd_config_show)

    db = commands.add_parser("db", help="manage the archive database")
    db_commands = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    db_upgrade = db_commands.add_parser("upgrade", help="apply schema migrations")
    _add_config_flags(db_upgrade)
    db_upgrade.add_argument("--revision", default="head", help="target revision (default head)")
    db_upgrade.set_defaults(handler=cmd_db_upgrade)
    db_current = db_commands.add_parser("current", help="print the schema revision")
    _add_config_flags(db_current)
    db_current.set_defaults(handler=cmd_db_current)

    probe = commands.add_parser(
        "probe", help="run probes once now, with progress and a results table"
    )
    _add_config_flags(probe)
    probe.add_argument(
        "--workload",
        action="append",
        help="workload, repeatable (default: from the configuration, probing.plan: every "
        "workload in the plan)",
    )
    probe.add_argument(
        "--precision",
        action="append",
        help="precision, repeatable (default: from the configuration, probing.plan: the "
        "workload's precisions there, else fp32)",
    )
    probe.add_argument(
        "--optimization",
        action="append",
        choices=OPTIMIZATIONS,
        help="eager, torch.compile'd or fast_accum (fp8 matmul), repeatable (default: from the "
        "configuration, probing.plan: the workload's optimizations there, else eager)",
    )
    probe.add_argument(
        "--duration",
        type=_positive_seconds,
        help="seconds per probe, at most 3600 (default: from the configuration, probing.plan: "
        "the workload's duration_seconds there, else 20)",
    )
    probe.add_argument("--device", help="'cpu', a GPU index or UUID (default: every GPU, else cpu)")
    probe.add_argument(
        "--size",
        choices=["small", "default"],
        help="problem size (default: the workload's default size, chosen from the device)",
    )
    probe.add_argument(
        "--force", action="store_true", help="run even if the device is busy (off by default)"
    )
    probe.add_argument(
        "--node",
        action="store_true",
        help="node-wide: each probe solo on every device, then on all of them at once, with "
        "each device's coupling ratio (off by default)",
    )
    probe.add_argument(
        "--json", action="store_true", help="machine-readable results (off by default: a table)"
    )
    probe.add_argument(
        "--record",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="archive the runs as the daemon does (default: from the configuration, "
        "probing.record, which is off)",
    )
    probe.set_defaults(handler=cmd_probe)

    analyze = commands.add_parser(
        "analyze", help="steady state versus peak of any series (CSV, JSON array, JSON lines)"
    )
    analyze.add_argument(
        "file",
        help="the series: CSV (with or without a header line), a JSON array or JSON lines; "
        "'-' reads standard input",
    )
    analyze.add_argument(
        "--column",
        help="column or field to read; in a CSV without a header line, its number from 1 "
        "(default: the only one)",
    )
    analyze.add_argument(
        "--kind",
        choices=["duration", "throughput"],
        default="duration",
        help="values are per-iteration durations (default) or throughputs",
    )
    analyze.add_argument(
        "--tolerance",
        type=float,
        default=0.02,
        metavar="R",
        help="relative equivalence of segments (default 0.02; Traini et al. used 0.05)",
    )
    analyze.add_argument(
        "--json", action="store_true", help="one JSON object (off by default: a summary)"
    )
    analyze.set_defaults(handler=cmd_analyze)
    _add_plot_flags(probe, analyze)
    _add_fleet_commands(commands)
    _add_health_command(commands)
    _add_report_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            status = _main(argv)
        finally:  # here, where a closed pipe can still be caught, not at exit (--help too)
            sys.stdout.flush()
    except BrokenPipeError:  # the reader of standard output went away: no traceback
        return closed_pipe()
    return status


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except UsageError as exc:
        print(f"sustain: error: {exc}", file=sys.stderr)
    except Exception as exc:
        # A ConfigError can only come from the settings module, so it is loaded if one is raised.
        settings_module = sys.modules.get("agent.config.settings")
        if settings_module is None or not isinstance(exc, settings_module.ConfigError):
            raise
        for problem in exc.problems:
            print(f"sustain: config: {problem}", file=sys.stderr)
    return EXIT_USAGE
