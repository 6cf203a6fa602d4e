"""The arguments of ``sustain runs`` (agent.cli.fleet.runs_list reads and prints the runs)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

OUTCOMES = ("ok", "failed", "timeout", "unsupported", "skipped", "aborted", "preempted")


def add_runs_command(
    commands: Any,
    add_config_flags: Callable[[argparse.ArgumentParser], None],
    handler: Callable[[argparse.Namespace], int],
) -> None:
    runs = commands.add_parser(
        "runs",
        help="the latest probe runs in the archive, newest first, with their ids",
        description="A line per run: its id (for sustain report run), start, node, device, "
        "probe, outcome and headline figure (the steady throughput; else the p10 of a run that "
        "never settled) or why it has none.",
    )
    add_config_flags(runs)
    runs.add_argument("--workload", help="one workload (default: every workload)")
    runs.add_argument("--precision", help="one precision (default: every precision)")
    runs.add_argument("--device", help="one device: its label (0, cpu) or UUID (default: all)")
    runs.add_argument("--node", help="one node (default: every node in the archive)")
    runs.add_argument(
        "--outcome",
        choices=OUTCOMES,
        help="one outcome (default: every outcome)",
    )
    runs.add_argument(
        "--since", help="runs from then on: 7d, 24h, 30m or an ISO date (default: any time)"
    )
    runs.add_argument(
        "--limit", type=_positive_count, default=20, help="at most this many runs (default 20)"
    )
    runs.add_argument("--json", action="store_true", help="a JSON array (off by default)")
    runs.set_defaults(handler=handler)


def _positive_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= 100_000:
        raise argparse.ArgumentTypeError(f"must be 1 to 100000: {text!r}")
    return value
