"""`sustain probe`: run probes once, here and now, and show the answer: peak, steady with its 99%
interval, the sustained ratio, warm-up, classification, the cause of a slowdown, and the p10/p50
of the throughput over one-second windows (what a run that never settles still delivered).

It goes through the daemon's own path (ProbeScheduler.run_analysed): the same production-first
checks (skipped when foreign compute processes are on the GPU or it is busy) and the same
yielding (a run is stopped, ``preempted``, when foreign work arrives on its device; ``--force``
overrides both), the same sampler loops feeding the attribution (NVML on GPUs, the host collector on
the CPU, ~10 Hz while a run runs), the same analysis child. It needs no running agent. With
``--record`` (or ``probing.record``) the runs are archived as the daemon's are, so ``sustain
capacity`` and ``sustain drift`` have data at once. The output is a block of labelled lines per
run that fits 80 columns; ``--json`` carries every figure under the keys docs/probe.md lists.
"""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from agent.archive.database import open_engine, upgrade
from agent.archive.sink import ArchiveSink
from agent.archive.spool import Spool
from agent.archive.stack_snapshots import StackNotFound, find, last_stack
from agent.cli.pipes import closed_pipe
from agent.config.names import NODE_WIDE
from agent.config.settings import ProbePlanEntry, Settings, redact_url
from agent.probes.analysis import RunAnalysis
from agent.probes.devices import TelemetryCapture, gpu_devices, plan_specs
from agent.probes.node import Coupling, node_members
from agent.probes.protocol import Iteration
from agent.probes.runner import CPU, ProbeDevice, ProbeRun, ProbeRunner, ProbeSpec
from agent.probes.scheduler import ProbeScheduler
from agent.stack.tracker import StackTracker
from agent.telemetry.sampler import SamplerLoop
from agent.telemetry.store import TelemetryStore
from collectors.base import Collector
from collectors.host import HostCollector
from collectors.nvml.collector import NvmlCollector
from collectors.nvml.library import NvmlLibrary
from collectors.processes import ProcessCpuMeter

PROBE_SPOOL = "probe-spool.db"  # beside the daemon's spool.db, never shared with it
DRAIN_SECONDS = 30.0


class ProbeUsageError(Exception):
    """The request names a device or a workload that is not there."""


@dataclass(frozen=True, slots=True)
class Request:
    workloads: Sequence[str]
    precisions: Sequence[str]
    optimizations: Sequence[str]
    duration: float | None
    device: str | None
    size: str | None
    force: bool
    record: bool = False
    node: bool = False  # each probe solo on every device, then node-wide: the coupling
    plot: Path | None = None  # a directory: one SVG per run (sustain[report])


def _collectors(settings: Settings, runner: ProbeRunner) -> list[Collector]:
    collectors: list[Collector] = []
    if settings.host.enabled:
        collectors.append(HostCollector(settings.host.procfs, settings.host.sysfs))
    if settings.nvml.enabled:
        collectors.append(NvmlCollector(own_pids=runner.child_pids))
    return collectors


def _devices(store: TelemetryStore, wanted: str | None) -> list[ProbeDevice]:
    gpus = gpu_devices(store)
    if wanted is None:
        return gpus or [CPU]
    if wanted == "cpu":
        return [CPU]
    # A GPU's index names all its MIG devices; a UUID names one.
    chosen = [gpu for gpu in gpus if wanted in (gpu.label, gpu.key)]
    if chosen:
        return chosen
    known = ", ".join(["cpu", *dict.fromkeys(gpu.label for gpu in gpus)])
    raise ProbeUsageError(f"no device {wanted!r} here (devices: {known})")


def _specs(
    settings: Settings, request: Request, devices: list[ProbeDevice], runner: ProbeRunner
) -> list[ProbeSpec]:
    """The daemon's plan (``plan_specs``) with the request's flags over it; a workload the plan
    does not list runs with the plan entry defaults (fp32, eager, 20 s)."""
    plan = {entry.workload: entry for entry in settings.probing.plan}
    return [
        spec
        for workload in list(request.workloads) or list(plan)
        for spec in plan_specs(
            settings.probing,
            # Not in the plan: the entry defaults; its schedule is never used here.
            plan.get(workload) or ProbePlanEntry(workload=workload, interval_seconds=3600),
            devices,
            runner,
            precisions=request.precisions,
            optimizations=request.optimizations,
            duration=request.duration,
            size=request.size,
        )
    ]


def ratios_to_best(runs: Sequence[ProbeRun]) -> dict[str, float]:
    """Each ok run's throughput against the best precision of the same workload, optimization,
    device and unit: a slow fallback path (fp16 on a CPU) shows as a small ratio."""
    best: dict[tuple[str, str, str, str], float] = {}
    for run in runs:
        if run.outcome == "ok" and run.throughput:
            key = _group(run)
            best[key] = max(best.get(key, 0.0), run.throughput)
    return {
        run.id: run.throughput / best[_group(run)]
        for run in runs
        if run.outcome == "ok" and run.throughput and best.get(_group(run))
    }


def _group(run: ProbeRun) -> tuple[str, str, str, str]:
    unit = str((run.manifest or {}).get("unit", ""))
    return run.spec.workload, run.spec.optimization, run.spec.device.key, unit


# The figures of ``figures_json`` that the analysis computes on one phase's iterations only (all of
# them for an unphased workload); ``throughput`` is the child's own, over every phase.
ANALYSED_FIGURES = (
    "peak",
    "steady",
    "steady_ci99",
    "sustained_ratio",
    "warmup_seconds",
    "p10",
    "p50",
)


def figures_json(analysis: RunAnalysis | None) -> dict[str, Any]:
    """The analysis under the keys docs/probe.md documents (``None`` where not stated)."""
    figures = {} if analysis is None else analysis.figures
    attribution = None if analysis is None else analysis.attribution
    ci = figures.get("steady_ci")
    return {
        "classification": figures.get("classification"),
        "classification_reason": figures.get("reason"),
        "peak": figures.get("peak_throughput"),
        "steady": figures.get("steady_throughput"),
        "steady_ci99": None if ci is None else list(ci),
        "sustained_ratio": figures.get("sustained_ratio"),
        "warmup_seconds": figures.get("warmup_seconds"),
        "p10": figures.get("p10_throughput"),
        "p50": figures.get("p50_throughput"),
        "window_seconds": figures.get("window_seconds"),
        "cause": None if attribution is None else attribution.cause,
        "cause_reason": None if attribution is None else attribution.reason,
        "work_per_joule": None if attribution is None else attribution.work_per_joule,
        "phase": figures.get("phase"),
    }


def _number(value: object) -> float | None:
    """A figure the child stated, as a float; None for anything else (it is not trusted)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _count(value: object) -> int | None:
    """An iteration count the child stated; None for anything else."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def phases_json(run: ProbeRun) -> dict[str, dict[str, Any]] | None:
    """Each phase of a phased workload (inference: prefill, decode; membw: copy, triad) as the
    child's result line states it: its iterations, work, timed seconds and throughput (work /
    seconds, over that phase's iterations only), with units, in the order the phases first ran.
    None for an unphased workload and for a run without a result line (one that was stopped)."""
    stated = (run.result or {}).get("phases")
    if not isinstance(stated, dict) or not stated:
        return None
    manifest = run.manifest or {}
    ran = [i.phase for i in run.iterations if i.phase is not None and i.phase in stated]
    order = list(dict.fromkeys(ran)) + sorted(name for name in stated if name not in ran)
    phases: dict[str, dict[str, Any]] = {}
    for name in order:
        entry = stated[name] if isinstance(stated[name], dict) else {}
        latency = entry.get("latency_seconds")
        if isinstance(latency, dict):
            latency = {key: _number(value) for key, value in latency.items()}
        phases[name] = {
            "iterations": _count(entry.get("iterations")),
            "work": _number(entry.get("work")),
            "work_unit": manifest.get("work_unit"),
            "seconds": _number(entry.get("duration")),
            "throughput": _number(entry.get("throughput")),
            "unit": manifest.get("unit"),
            "latency_seconds": latency if isinstance(latency, dict) else None,
        }
    return phases


def coverage_json(run: ProbeRun, analysis: RunAnalysis | None) -> dict[str, Any]:
    """What each figure of the run covers: the analysed figures one phase (``analysis``), the
    ``throughput`` every phase (``throughput``); either is None where the run has no such figure.
    Documented in docs/probe.md."""
    unit = (run.manifest or {}).get("unit")
    analysed = None
    if analysis is not None:
        phase = analysis.figures.get("phase")
        analysed = {
            "figures": list(ANALYSED_FIGURES),
            "phase": phase,
            "iterations": sum(1 for iteration in run.iterations if iteration.phase == phase),
            "unit": unit,
        }
    whole = None
    if run.throughput is not None:
        phases = phases_json(run)
        whole = {
            "figures": ["throughput"],
            "phases": None if phases is None else list(phases),
            "iterations": _count((run.result or {}).get("iterations")),
            "unit": unit,
        }
    return {"analysis": analysed, "throughput": whole}


def run_json(
    run: ProbeRun,
    analysis: RunAnalysis | None,
    ratio: float | None,
    coupling: Coupling | None = None,
) -> dict[str, Any]:
    return {
        "id": run.id,
        "scope": run.spec.scope,
        "group": run.group,
        "coupling_ratio": None if coupling is None else coupling.ratio,
        "coupling_cause": None if coupling is None else coupling.cause,
        "coupling_reason": None if coupling is None else coupling.reason,
        "workload": run.spec.workload,
        "precision": run.spec.precision,
        "optimization": run.spec.optimization,
        "device": run.spec.device.label,
        "uuid": run.spec.device.key if run.spec.device.kind == "cuda" else None,
        "outcome": run.outcome,
        "reason": run.reason,
        "started_at": run.started_at,
        "ended_at": run.ended_at,
        "iterations": len(run.iterations),
        "throughput": run.throughput,
        "unit": (run.manifest or {}).get("unit"),
        "ratio_to_best": ratio,
        **figures_json(analysis),
        "phases": phases_json(run),
        "figures_cover": coverage_json(run, analysis),
        "analysis": None if analysis is None else analysis.as_dict(),
        "manifest": run.manifest,
        "result": run.result,
        "exit_code": run.exit_code,
        # pid, name, where, seen_at
        "preempted_by": None if run.preempted_by is None else asdict(run.preempted_by),
    }


def _human(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


class _ProgressFeed:
    """Moves one probe's bar as its iterations arrive (called from the runner's reader thread;
    rich's Progress is thread-safe)."""

    def __init__(self, progress: Progress, spec: ProbeSpec) -> None:
        self._progress = progress
        self._duration = spec.duration_seconds
        self._first: float | None = None
        self.task = progress.add_task(spec.name, total=spec.duration_seconds, status="starting")

    def __call__(self, iteration: Iteration) -> None:
        if self._first is None:
            self._first = iteration.start
        self._progress.update(
            self.task,
            completed=min(self._duration, iteration.end - self._first),
            status=f"{iteration.index + 1} iterations",
        )


class _Recorder:
    """``--record``: the daemon's archive path (a spool drained into the database, the stack
    each run ran on), with a spool file of its own so that a running daemon's is never shared."""

    def __init__(self, settings: Settings, nvml: NvmlLibrary | None, python: str) -> None:
        engine = open_engine(settings.database_url)
        upgrade(engine)
        node = settings.agent.node
        previous = last_stack(engine, node)
        try:
            stored = find(engine, previous) if previous is not None else None
        except StackNotFound:
            stored = None
        spool = Spool(settings.agent.data_dir.absolute() / PROBE_SPOOL)
        self.sink = ArchiveSink(engine, node, spool)
        self.sink.drain()  # what an earlier `sustain probe --record` could not write
        self.stacks = StackTracker(
            self.sink,
            nvml=nvml,
            python=python,
            previous=None if stored is None else (stored.stack_id, stored.facts),
            container_image=settings.stack.container_image,
        )
        self._engine = engine

    def close(self) -> str | None:
        """Write what is spooled; the problem in one line when some of it could not be."""
        drained = self.sink.drain(deadline=time.monotonic() + DRAIN_SECONDS)
        self.sink.spool.close()
        self._engine.dispose()
        if drained:
            return None
        return (
            f"some results are not archived yet (the database did not take them): they wait in "
            f"{self.sink.spool.path} for the next `sustain probe --record`"
        )


def _node_plan(
    request: Request, devices: list[ProbeDevice], specs: list[ProbeSpec]
) -> tuple[list[ProbeDevice], list[ProbeSpec]]:
    """``--node``: the devices of a node-wide run and one spec per probe, run after the solo
    runs of ``specs`` (their reference). A CPU node with one NUMA node has none: said so."""
    if not request.node:
        return [], []
    members = node_members(devices)
    if len(members) == 1 and members[0].kind == "cpu":
        print(
            "sustain probe: --node on a CPU node with one NUMA node is the solo run",
            file=sys.stderr,
        )
        return [], []
    # A node-wide workload (allreduce) already ran on every GPU at once: no second, per-device run.
    probes = {
        (spec.workload, spec.precision, spec.optimization): spec
        for spec in specs
        if spec.workload not in NODE_WIDE
    }
    return members, list(probes.values())


def run_probes(settings: Settings, request: Request, as_json: bool) -> int:
    runner = ProbeRunner(
        python=settings.probing.python,
        startup_timeout_seconds=settings.probing.startup_timeout_seconds,
        grace_seconds=settings.probing.run_grace_seconds,
    )
    store = TelemetryStore(settings.sampler.buffer_samples)
    capture = TelemetryCapture()
    collectors = _collectors(settings, runner)
    loops = [
        SamplerLoop(
            collector,
            settings.sampler.interval_seconds,
            sinks=(store.record, capture.record),
            stall_seconds=settings.sampler.stall_seconds,
        )
        for collector in collectors
    ]
    for loop in loops:
        loop.poll_once()  # enough to find the devices and any foreign work on them
    devices = _devices(store, request.device)
    specs = _specs(settings, request, devices, runner)
    members, node_specs = _node_plan(request, devices, specs)
    nvml = next((c for c in collectors if isinstance(c, NvmlCollector)), None)
    recorder = (
        _Recorder(settings, None if nvml is None else nvml.library, runner.python)
        if request.record
        else None
    )
    scheduler = ProbeScheduler(
        settings.probing,
        runner,
        store,
        capture,
        loops,
        settings.sampler.interval_seconds,
        writer=None if recorder is None else recorder.sink,
        stacks=None if recorder is None else recorder.stacks,
        processes=ProcessCpuMeter(settings.host.procfs),
    )
    for loop in loops:
        loop.start()  # telemetry through the runs, at ~10 Hz while one runs: the attribution's
    results: list[tuple[ProbeRun, RunAnalysis | None]] = []
    try:
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=20),
            TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        ) as progress:
            for spec in specs:
                feed = _ProgressFeed(progress, spec)
                run, analysis = scheduler.run_analysed(spec, request.force, on_iteration=feed)
                progress.update(feed.task, completed=spec.duration_seconds, status=run.outcome)
                results.append((run, analysis))
            for spec in node_specs:
                task = progress.add_task(
                    f"{spec.workload} {spec.precision} node-wide on {len(members)} devices",
                    total=None,
                    status="running",
                )
                node_results = scheduler.run_node_analysed(spec, members, request.force)
                progress.update(task, status=node_results[-1][0].outcome)
                results += node_results
    finally:
        for loop in loops:
            loop.request_stop()
        for loop in loops:
            loop.join(5.0)
        for collector in collectors:
            collector.close()
    problem = None if recorder is None else recorder.close()
    status = _show(results, scheduler, request, as_json, settings, recorded=problem is None)
    _plot(results, request.plot)
    if problem is not None:
        print(f"sustain probe: {problem}", file=sys.stderr)
        return 1
    if results and all(run.outcome == "skipped" for run, _ in results):
        print(
            "sustain probe: every run was skipped (each one's reason is in the output); "
            "--force runs even on a busy device",
            file=sys.stderr,
        )
        return status or 1
    if status is not None:
        return status
    return 0 if all(run.outcome in ("ok", "unsupported", "skipped") for run, _ in results) else 1


def _show(
    results: Sequence[tuple[ProbeRun, RunAnalysis | None]],
    scheduler: ProbeScheduler,
    request: Request,
    as_json: bool,
    settings: Settings,
    *,
    recorded: bool,
) -> int | None:
    """Print the runs, each against the best of its group; the status of a closed pipe, else
    None."""
    ratios = ratios_to_best([run for run, _ in results if run.spec.scope == "device"])
    couplings = {
        run.id: coupling
        for run, _ in results
        if run.spec.scope != "device" and (coupling := scheduler.coupling(run.spec)) is not None
    }
    try:
        if as_json:
            document = {
                "runs": [
                    run_json(run, analysis, ratios.get(run.id), couplings.get(run.id))
                    for run, analysis in results
                ],
                "recorded": request.record and recorded,
            }
            json.dump(document, sys.stdout, indent=2, allow_nan=False)
            sys.stdout.write("\n")
        else:
            width = max(60, min(shutil.get_terminal_size((80, 24)).columns, 100))
            print(
                "\n\n".join(
                    render_run(run, analysis, ratios.get(run.id), width, couplings.get(run.id))
                    for run, analysis in results
                )
            )
            if request.record and recorded:
                runs = f"{len(results)} run{'' if len(results) == 1 else 's'}"
                print(f"\narchived {runs} in {redact_url(settings.database_url)}")
        sys.stdout.flush()
    except BrokenPipeError:  # `sustain probe | head`: the runs are archived and plotted still
        return closed_pipe()
    return None


def _plot(results: Sequence[tuple[ProbeRun, RunAnalysis | None]], directory: Path | None) -> None:
    """``--plot DIR``: one picture per run (agent.cli.report, which loads matplotlib)."""
    if directory is None:
        return
    from agent.cli.report import plot_probe_runs, say_written

    say_written(plot_probe_runs(results, directory))


LABEL_WIDTH = 12


def render_run(
    run: ProbeRun,
    analysis: RunAnalysis | None,
    ratio: float | None,
    width: int = 80,
    coupling: Coupling | None = None,
) -> str:
    """One run as a block of labelled lines that fits ``width`` columns."""
    spec = run.spec
    unit = str((run.manifest or {}).get("unit", ""))
    where = spec.device.title
    if spec.scope == "node":
        where += " (node-wide)"
    elif spec.scope == "node_total":
        where = f"the node ({len(spec.device.members)} devices at once)"
    head = f"{spec.workload} {spec.precision} {spec.optimization} on {where}: "
    head += run.outcome
    if run.iterations:
        seconds = run.iterations[-1].end - run.iterations[0].start
        head += f", {len(run.iterations)} iterations in {seconds:.1f} s"
    lines: list[tuple[str | None, str]] = [(None, head)]
    if run.reason:
        lines.append(("reason", run.reason))
    lines += _measured_lines(run, analysis, unit)
    if ratio is not None and ratio < 1.0:
        lines.append(("vs best", f"{ratio:.3g} of the best precision of this workload here"))
    if coupling is not None:
        alone = "the sum of the solo runs" if spec.scope == "node_total" else "its solo run"
        text = f"{coupling.ratio:.3f} of {alone} ({coupling.compared})"
        if coupling.cause is not None:
            text += f"; {coupling.cause}: {coupling.reason}"
        lines.append(("coupling", text))
    out: list[str] = []
    for label, text in lines:
        if label is None:
            out += textwrap.wrap(text, width, subsequent_indent="    ") or [""]
            continue
        prefix = f"  {label:<{LABEL_WIDTH}}"
        out += textwrap.wrap(
            text, width, initial_indent=prefix, subsequent_indent=" " * len(prefix)
        )
    return "\n".join(out)


def _phase_lines(
    run: ProbeRun, phases: dict[str, dict[str, Any]], unit: str
) -> list[tuple[str | None, str]]:
    """The run's own throughput over every phase, then each phase's."""
    count = _count((run.result or {}).get("iterations"))
    every = "every phase" if count is None else f"every phase, {_iterations(count)}"
    lines: list[tuple[str | None, str]] = [
        ("throughput", f"{_human(run.throughput, unit)}: {every} (total work / total time)")
    ]
    for name, phase in phases.items():
        text = f"{_human(phase['throughput'], unit)}: {_iterations(phase['iterations'])}"
        if phase["seconds"] is not None:
            text += f" in {phase['seconds']:.3g} s"
        latency = phase["latency_seconds"]
        if latency is not None:
            quantiles = ", ".join(
                f"{key} {_duration(value)}" for key, value in latency.items() if value is not None
            )
            text += f"; step latency {quantiles}"
        lines.append((name, text))
    return lines


def _iterations(count: int | None) -> str:
    return f"{count} iteration" + ("" if count == 1 else "s")


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1.0 else f"{seconds:.3g} s"


def _measured_lines(
    run: ProbeRun, analysis: RunAnalysis | None, unit: str
) -> list[tuple[str | None, str]]:
    """What the run measured: of a phased run, the throughput of every phase and of each, then
    the analysis' figures, after the name of the phase they are about."""
    phases = phases_json(run)
    lines = [] if phases is None else _phase_lines(run, phases, unit)
    if analysis is not None:
        if phases is not None:
            phase = analysis.figures.get("phase")
            count = sum(1 for iteration in run.iterations if iteration.phase == phase)
            text = f"{phase} only: the figures below are of its {_iterations(count)}"
            lines.append(("analysed", text))
        lines += _figure_lines(figures_json(analysis), unit)
    elif run.outcome == "ok" and phases is None:
        text = f"{_human(run.throughput, unit)} (all iterations; not analysed)"
        lines.append(("throughput", text))
    elif run.outcome == "preempted":
        kept = f"{len(run.iterations)} iterations kept for inspection; no figures from a run"
        lines.append(("series", f"{kept} that yielded to production"))
    return lines


def _figure_lines(figures: dict[str, Any], unit: str) -> list[tuple[str | None, str]]:
    lines: list[tuple[str | None, str]] = [("peak", _human(figures["peak"], unit))]
    steady = figures["steady"]
    if steady is not None:
        text = _human(steady, unit)
        if figures["steady_ci99"] is not None:
            low, high = figures["steady_ci99"]
            text += f" (99% interval {_human(low, unit)} to {_human(high, unit)})"
        lines.append(("steady", text))
    elif figures["classification"] == "insufficient":
        lines.append(("steady", "not decided: too few iterations (p10 is what it delivered)"))
    else:
        lines.append(("steady", "none: no steady state in this run (p10 is what it delivered)"))
    if figures["sustained_ratio"] is not None:
        lines.append(("sustained", f"{figures['sustained_ratio']:.3f} of peak (steady / peak)"))
    else:
        lines.append(("sustained", "not stated without a steady state"))
    if figures["warmup_seconds"] is not None:
        text = f"{figures['warmup_seconds']:.1f} s before the steady state"
        if figures["classification"] == "slowdown":
            text += " (faster before it: a slowdown)"
        lines.append(("warm-up", text))
    else:
        lines.append(("warm-up", "not stated without a steady state"))
    if figures["p10"] is not None:
        window = figures["window_seconds"] or 1.0
        lines.append(
            (
                "windows",
                f"p10 {_human(figures['p10'], unit)}, p50 {_human(figures['p50'], unit)} "
                f"over {window:g}-second windows",
            )
        )
    classification = str(figures["classification"])
    if figures["classification_reason"]:
        classification += f": {figures['classification_reason']}"
    lines.append(("class", classification))
    cause = figures["cause"] or "none"
    if figures["cause_reason"]:
        cause += f" ({figures['cause_reason']})"
    lines.append(("cause", cause))
    return lines
