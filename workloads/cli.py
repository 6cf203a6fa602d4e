"""`python -m workloads run|list|facts`: the command line the agent's probe runner calls.

The daemon never imports this package (nor torch); it starts this command as a child process and
reads its standard output, so the arguments and the JSON lines (README.md) are the interface.
A usage error is one line on stderr and exit code 2, as everywhere in sustain; an exception
inside a run is left to propagate, so the agent records a non-zero exit and the traceback's last
lines.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch

from workloads import affinity, catalog, facts, runner
from workloads import device as devices
from workloads import precision as precisions
from workloads.device import DeviceInfo
from workloads.protocol import Emitter
from workloads.registry import WORKLOADS
from workloads.workload import Request, Workload


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, not argparse's usage block: the agent keeps the last lines of stderr."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def _device(text: str) -> str:
    try:
        devices.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text!r}")
    return value


def _cpus(text: str) -> frozenset[int]:
    try:
        return affinity.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return int(text)


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}")
    return int(text)


def _parser() -> _Parser:
    parser = _Parser(prog="workloads", description="sustain probe workloads (JSON lines out)")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run one probe and stream its iterations")
    run.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    run.add_argument("--precision", required=True)
    run.add_argument("--optimization", default="eager", choices=catalog.OPTIMIZATIONS)
    run.add_argument("--duration", type=_positive_float, help="seconds; default per workload")
    run.add_argument("--device", required=True, type=_device, help="cpu, cuda or cuda:N")
    run.add_argument("--max-iterations", type=_positive_int)
    run.add_argument(
        "--min-iterations",
        type=_positive_int,
        help="size the problem so that this many iterations fit the duration (default: as is)",
    )
    run.add_argument(
        "--neighbours",
        type=_count,
        default=0,
        help="other children measured at once (a node-wide run): size the problem for this "
        "many more times the minimum of iterations (default 0)",
    )
    run.add_argument("--size", default="default", choices=["small", "default"])
    run.add_argument(
        "--threads",
        type=_positive_int,
        help="torch intra-op threads (default: torch's, at most one per CPU of --cpus)",
    )
    run.add_argument(
        "--ranks",
        type=_positive_int,
        help="allreduce on a CPU: this many ranks over gloo (on GPUs: one per visible GPU)",
    )
    run.add_argument(
        "--cpus",
        type=_cpus,
        help="bind to these CPUs first (comma-separated numbers: the GPU's nearest)",
    )
    run.add_argument(
        "--start-on-stdin",
        action="store_true",
        help="after the manifest, wait for a line on stdin before the first iteration "
        "(end of input: stop without measuring)",
    )
    run.add_argument("--flush-cache", action="store_true", help="matmul: cold caches")
    run.add_argument("--causal", action="store_true", help="attention: causal mask")

    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, text in (
        ("list", "the workloads and what the device supports: a table, or --json"),
        ("facts", "torch versions and backend switches"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("--device", default=default_device, type=_device)
    commands.choices["list"].add_argument(
        "--json", action="store_true", help="one JSON object, as the agent reads it"
    )
    return parser


def main(
    argv: Sequence[str] | None = None, *, before_output: Callable[[], None] = lambda: None
) -> int:
    """``before_output``: called before the table of ``list`` is printed (a spinner's stop)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        workload = WORKLOADS[args.workload]
        _check_run_arguments(parser, args, workload)
    if args.command == "list" and not args.json:
        listing = describe_workloads(args.device)
        before_output()
        return _print_table(listing)
    emitter = Emitter.claim_stdout()
    if args.command == "list":
        emitter.emit(describe_workloads(args.device))
    elif args.command == "facts":
        device, reason = runner.device_or_reason(args.device)
        emitter.emit(facts.facts(device, reason))
    else:
        # First, before any buffer is allocated: pinned memory lands on the bound CPUs' node; and
        # before any parallel work, so that torch's thread pools still take the bound CPU count.
        binding = None if args.cpus is None else affinity.bind(args.cpus)
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        request = Request(
            precision=args.precision,
            optimization=args.optimization,
            size=args.size,
            flush_cache=args.flush_cache,
            causal=args.causal,
            ranks=args.ranks,
        )
        duration = args.duration or workload.spec.default_duration
        runner.run(
            workload,
            request,
            args.device,
            duration=duration,
            max_iterations=args.max_iterations,
            emitter=emitter,
            min_iterations=args.min_iterations,
            neighbours=args.neighbours,
            cpu_binding=binding,
            start=_line_on_stdin if args.start_on_stdin else None,
        )
    return 0


def _line_on_stdin() -> bool:
    """The start signal of a node-wide run: a line on stdin; end of input means stop."""
    return bool(sys.stdin.readline())


def _check_run_arguments(
    parser: _Parser, args: argparse.Namespace, workload: type[Workload]
) -> None:
    """Arguments the workload does not declare are usage errors; what the device lacks is not."""
    spec = workload.spec
    if args.precision not in spec.precisions:
        known = ", ".join(spec.precisions)
        parser.error(f"{spec.name} has no precision {args.precision!r} (it has {known})")
    if args.optimization not in spec.optimizations:
        parser.error(f"{spec.name} has no optimization level {args.optimization!r}")
    if args.flush_cache and spec.name != "matmul":
        parser.error("--flush-cache applies to matmul only")
    if args.causal and spec.name != "attention":
        parser.error("--causal applies to attention only")
    if args.ranks is not None and spec.name != "allreduce":
        parser.error("--ranks applies to allreduce only")
    if args.ranks == 1:
        parser.error("--ranks must be 2 or more (an all-reduce needs a peer)")


def _print_table(listing: dict[str, Any]) -> int:
    try:
        print(listing_table(listing))
        sys.stdout.flush()
    except BrokenPipeError:  # `python -m workloads list | head`: no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE
    return 0


def listing_table(listing: dict[str, Any]) -> str:
    """``list`` for a person: a line per workload with what runs here, then why the rest
    does not (or runs without native support)."""
    native = {p: entry["native"] for p, entry in listing["precisions"].items()}
    rows = [("WORKLOAD", "UNIT", "PRECISIONS", "OPTIMIZATIONS")]
    notes: list[str] = []
    for name, entry in listing["workloads"].items():
        runs = [p for p, s in entry["precisions"].items() if s["supported"]]
        levels = [o for o, s in entry["optimizations"].items() if s["supported"]]
        shown = [p if native.get(p, True) else f"{p}*" for p in runs]
        rows.append((name, entry["unit"], " ".join(shown) or "-", " ".join(levels) or "-"))
        if not entry["applies"]:
            notes.append(f"  {name}: {entry['reason']}")
            continue
        notes += [
            f"  {name} {p}: {s['reason']}" for p, s in entry["precisions"].items() if s["reason"]
        ]
        notes += [
            f"  {name} {o}: {s['reason']}"
            for o, s in entry["optimizations"].items()
            if s["reason"] and s["reason"] not in {n.split(": ", 1)[-1] for n in notes}
        ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"device {listing['device']}"]
    if listing["device_unavailable"]:
        lines.append(f"unavailable: {listing['device_unavailable']}")
    lines += [
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:3])) + "  " + row[3]
        for row in rows
    ]
    slow = [(p, e["reason"]) for p, e in listing["precisions"].items() if not e["native"]]
    if slow:
        lines.append("* runs without native support, left out of the default plan:")
        lines += [f"  {p}: {reason}" for p, reason in slow]
    if notes:
        lines.append("not supported here:")
        lines += notes
    return "\n".join(lines)


def describe_workloads(device_spec: str) -> dict[str, Any]:
    device, device_reason = runner.device_or_reason(device_spec)
    return {
        "device": device_spec if device is None else device.torch_device,
        "device_unavailable": device_reason,
        "precisions": {} if device is None else native_precisions(device),
        "workloads": {
            name: _describe(workload, device, device_reason) for name, workload in WORKLOADS.items()
        },
    }


def native_precisions(device: DeviceInfo) -> dict[str, dict[str, Any]]:
    """Whether the device runs each precision natively, and why not: the agent leaves the
    others out of its default plan."""
    reasons = {p: precisions.native_reason(p, device) for p in precisions.PRECISIONS}
    return {p: {"native": why is None, "reason": why} for p, why in reasons.items()}


def _describe(
    workload: type[Workload], device: DeviceInfo | None, device_reason: str | None
) -> dict[str, Any]:
    spec = workload.spec

    def support(precision: str, optimization: str) -> dict[str, Any]:
        if device is None:
            reason = device_reason
        else:
            reason = workload.unsupported_reason(device, precision, optimization)
        return {"supported": reason is None, "reason": reason}

    by_precision = {p: support(p, "eager") for p in spec.precisions}
    runnable = [p for p, s in by_precision.items() if s["supported"]]

    def level(optimization: str) -> dict[str, Any]:
        """Judged at the first supported precision the level applies to (fast_accum: fp8)."""
        applies = catalog.LEVEL_PRECISIONS.get((spec.name, optimization), spec.precisions)
        return support(next((p for p in runnable if p in applies), applies[0]), optimization)

    return {
        "version": spec.version,
        "unit": spec.unit,
        "work_unit": spec.work_unit,
        "default_duration": spec.default_duration,
        "devices": list(spec.devices),
        "applies": bool(runnable),
        "reason": None if runnable else by_precision[spec.precisions[0]]["reason"],
        "precisions": by_precision,
        "optimizations": {o: level(o) for o in spec.optimizations},
    }
