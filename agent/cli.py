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
from typing import Any, NoReturn

import tomli_w

from agent import __version__, config

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
    parser.add_argument("--database", metavar="URL", help="archive database URL (SQLAlchemy)")
    parser.add_argument("--data-dir", type=Path, help="directory for the embedded SQLite archive")


def _settings(args: argparse.Namespace) -> config.Settings:
    overrides: dict[str, dict[str, Any]] = {}
    if getattr(args, "database", None):
        overrides.setdefault("archive", {})["database_url"] = args.database
    if getattr(args, "data_dir", None):
        overrides.setdefault("agent", {})["data_dir"] = args.data_dir
    if getattr(args, "listen", None):
        overrides.setdefault("exporter", {})["listen"] = args.listen
    if getattr(args, "log_level", None):
        overrides.setdefault("agent", {})["log_level"] = args.log_level
    return config.load(args.config, overrides)


def _without_none(value: Any) -> Any:
    """TOML has no null: unset keys are left out of `config show`."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


def cmd_run(args: argparse.Namespace) -> int:
    from agent import daemon  # the daemon's imports are only paid for by `run`

    settings = _settings(args)
    logging.basicConfig(
        level=settings.agent.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # The scheduler logs every job run at INFO, and Alembic its internals: keep the log readable.
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    try:
        return daemon.run(settings)
    except daemon.StartupError as exc:
        raise UsageError(str(exc)) from None


def cmd_config_check(args: argparse.Namespace) -> int:
    problems = config.check_file(args.file)
    if problems:
        for problem in problems:
            print(problem)
        return EXIT_USAGE
    print("ok")
    return EXIT_OK


def cmd_config_show(args: argparse.Namespace) -> int:
    print(tomli_w.dumps(_without_none(config.redacted(_settings(args)))), end="")
    return EXIT_OK


def _open_archive(args: argparse.Namespace) -> Any:
    from agent.archive.database import ArchiveError, open_engine

    settings = _settings(args)
    try:
        return open_engine(settings.database_url)
    except ArchiveError as exc:
        raise UsageError(str(exc)) from None


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from agent.archive.database import ArchiveError, current_revision, upgrade

    engine = _open_archive(args)
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
        print(current_revision(engine) or "empty (no migration applied)")
    except ArchiveError as exc:
        raise UsageError(str(exc)) from None
    finally:
        engine.dispose()
    return EXIT_OK


def cmd_probe(args: argparse.Namespace) -> int:
    from agent import probe_command

    settings = _settings(args)
    request = probe_command.Request(
        workloads=args.workload or [],
        precisions=args.precision or [],
        optimizations=args.optimization or [],
        duration=args.duration,
        device=args.device,
        size=args.size,
        force=args.force,
    )
    try:
        return probe_command.run_probes(settings, request, as_json=args.json)
    except probe_command.ProbeUsageError as exc:
        raise UsageError(str(exc)) from None


def cmd_analyze(args: argparse.Namespace) -> int:
    from agent.analysis import InvalidSeriesError
    from agent.analysis.input import SeriesInputError, analyze_file
    from agent.analysis.summary import render_summary

    try:
        result = analyze_file(args.file, args.column, args.kind, args.tolerance)
    except (SeriesInputError, InvalidSeriesError) as exc:
        raise UsageError(str(exc)) from None
    unit = "iterations/s" if args.kind == "duration" else "work/s"
    print(result.to_json() if args.json else render_summary(result, unit))
    return EXIT_OK


def _fleet(args: argparse.Namespace, action: Callable[[Any], str], archive: bool = True) -> int:
    """Run a read-only archive command: its text on stdout, a FleetUsageError as one line."""
    from agent import fleet_command
    from agent.archive.database import ArchiveError

    engine = _open_archive(args) if archive else None
    try:
        fleet_command.emit(action(engine))
    except (fleet_command.FleetUsageError, ArchiveError) as exc:
        raise UsageError(str(exc)) from None
    finally:
        if engine is not None:
            engine.dispose()
    return EXIT_OK


def cmd_stack_show(args: argparse.Namespace) -> int:
    from agent.fleet_command import stack_show

    return _fleet(
        args, lambda engine: stack_show(engine, args.stack, args.json), archive=bool(args.stack)
    )


def cmd_stack_diff(args: argparse.Namespace) -> int:
    from agent.fleet_command import stack_diff

    return _fleet(args, lambda engine: stack_diff(engine, args.a, args.b))


def cmd_stack_history(args: argparse.Namespace) -> int:
    from agent.fleet_command import stack_history

    return _fleet(args, lambda engine: stack_history(engine, args.node, args.json))


def cmd_drift(args: argparse.Namespace) -> int:
    from agent.fleet_command import drift_report

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


def cmd_capacity(args: argparse.Namespace) -> int:
    from agent.fleet_command import capacity_report

    return _fleet(
        args,
        lambda engine: capacity_report(
            engine,
            by=args.by,
            precision=args.precision,
            workload=args.workload,
            optimization=args.optimization,
            since_text=args.since,
            as_json=args.json,
        ),
    )


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"must be in (0, 3600] seconds: {text!r}")
    return value


def _add_fleet_commands(commands: Any) -> None:
    """stack, drift and capacity: the commands that read the archive."""
    stack = commands.add_parser("stack", help="the software stack results are measured on")
    stack_commands = stack.add_subparsers(dest="stack_command", required=True, metavar="ACTION")
    show_stack = stack_commands.add_parser(
        "show", help="this machine's stack now, or a stored one by id (prefix)"
    )
    _add_config_flags(show_stack)
    show_stack.add_argument("stack", nargs="?", help="stack id or prefix (default: read it now)")
    show_stack.add_argument("--json", action="store_true", help="one JSON object")
    show_stack.set_defaults(handler=cmd_stack_show)
    diff_stack = stack_commands.add_parser("diff", help="two stored stacks, field by field")
    _add_config_flags(diff_stack)
    diff_stack.add_argument("a", help="old stack id or prefix")
    diff_stack.add_argument("b", help="new stack id or prefix")
    diff_stack.set_defaults(handler=cmd_stack_diff)
    stack_history = stack_commands.add_parser("history", help="stack changes, oldest first")
    _add_config_flags(stack_history)
    stack_history.add_argument("--node", help="one node (default: every node in the archive)")
    stack_history.add_argument("--json", action="store_true", help="a JSON array")
    stack_history.set_defaults(handler=cmd_stack_history)

    drift = commands.add_parser(
        "drift", help="lasting changes in sustained throughput, their causes, fleet outliers"
    )
    _add_config_flags(drift)
    drift.add_argument("--since", help="changes from then on: 7d, 24h, 30m or an ISO date/time")
    drift.add_argument("--node", help="one node's devices (peers still come from every node)")
    drift.add_argument("--json", action="store_true", help="one JSON object")
    drift.set_defaults(handler=cmd_drift)

    capacity = commands.add_parser(
        "capacity", help="sustained throughput per GPU model, node or stack (median, p10)"
    )
    _add_config_flags(capacity)
    capacity.add_argument("--by", choices=["model", "node", "stack"], default="model")
    capacity.add_argument("--precision", help="one precision, e.g. bf16")
    capacity.add_argument("--workload", help="one workload, e.g. matmul")
    capacity.add_argument("--optimization", choices=["eager", "compiled"])
    capacity.add_argument("--since", help="results from then on: 7d, 24h, 30m or an ISO date")
    capacity.add_argument("--json", action="store_true", help="a JSON array")
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
        "--listen", metavar="HOST:PORT", help="exporter address (default 0.0.0.0:9477)"
    )
    run.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    run.set_defaults(handler=cmd_run)

    cfg = commands.add_parser("config", help="check or show the configuration")
    cfg_commands = cfg.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    check = cfg_commands.add_parser(
        "check", help="validate a TOML file: 'ok' or one line per problem"
    )
    check.add_argument("file", type=Path)
    check.set_defaults(handler=cmd_config_check)
    show = cfg_commands.add_parser(
        "show", help="print the effective configuration, secrets redacted"
    )
    _add_config_flags(show)
    show.add_argument("--listen", metavar="HOST:PORT")
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
    probe.add_argument("--workload", action="append", help="workload (repeatable; default: plan)")
    probe.add_argument("--precision", action="append", help="precision (repeatable)")
    probe.add_argument(
        "--optimization", action="append", choices=["eager", "compiled"], help="(repeatable)"
    )
    probe.add_argument("--duration", type=_positive_seconds, help="seconds per probe")
    probe.add_argument("--device", help="'cpu', a GPU index or UUID (default: every GPU, else cpu)")
    probe.add_argument("--size", choices=["small", "default"], help="problem size")
    probe.add_argument("--force", action="store_true", help="run even if the device is busy")
    probe.add_argument("--json", action="store_true", help="machine-readable results")
    probe.set_defaults(handler=cmd_probe)

    analyze = commands.add_parser(
        "analyze", help="steady state versus peak of any series (CSV, JSON array, JSON lines)"
    )
    analyze.add_argument("file", type=Path)
    analyze.add_argument("--column", help="column or field to read (default: the only one)")
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
    analyze.add_argument("--json", action="store_true", help="one JSON object")
    analyze.set_defaults(handler=cmd_analyze)
    _add_fleet_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except config.ConfigError as exc:
        for problem in exc.problems:
            print(f"sustain: config: {problem}", file=sys.stderr)
    except UsageError as exc:
        print(f"sustain: error: {exc}", file=sys.stderr)
    return EXIT_USAGE
