"""`sustain probe`: run probes once, here and now, with a progress bar each and a results table.

It uses the same runner and the same production-first checks as the daemon (skipped when
foreign compute processes are on the GPU or it is busy; ``--force`` overrides), and needs no
running agent. Results are printed, not archived: the daemon's scheduled probes are the record.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from agent.buffers import TelemetryStore
from agent.config import Settings
from agent.probes import CPU, Iteration, ProbeDevice, ProbeRun, ProbeRunner, ProbeSpec
from agent.probing import ProbeScheduler, TelemetryCapture, gpu_devices
from collectors.base import CollectorError
from collectors.host import HostCollector
from collectors.nvml import NvmlCollector


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


def _discover(settings: Settings, runner: ProbeRunner) -> TelemetryStore:
    """One poll of the host and the GPUs: enough to find devices and foreign work."""
    store = TelemetryStore(16)
    collectors: list[HostCollector | NvmlCollector] = []
    if settings.host.enabled:
        collectors.append(HostCollector(settings.host.procfs, settings.host.sysfs))
    if settings.nvml.enabled:
        collectors.append(NvmlCollector(own_pids=runner.child_pids))
    for collector in collectors:
        try:
            for sample in collector.collect():
                store.record(sample)
        except CollectorError:
            pass  # no driver or nothing readable: probes run on the CPU
        finally:
            collector.close()
    return store


def _devices(store: TelemetryStore, wanted: str | None) -> list[ProbeDevice]:
    gpus = gpu_devices(store)
    if wanted is None:
        return gpus or [CPU]
    if wanted == "cpu":
        return [CPU]
    for gpu in gpus:
        if wanted in (gpu.label, gpu.key):
            return [gpu]
    known = ", ".join(["cpu", *(gpu.label for gpu in gpus)])
    raise ProbeUsageError(f"no device {wanted!r} here (devices: {known})")


def _specs(settings: Settings, request: Request, devices: list[ProbeDevice]) -> list[ProbeSpec]:
    plan = {entry.workload: entry for entry in settings.probing.plan}
    workloads = list(request.workloads) or list(plan)
    specs = []
    for device in devices:
        for workload in workloads:
            entry = plan.get(workload)
            precisions = list(request.precisions) or (entry.precisions if entry else ["fp32"])
            optimizations = list(request.optimizations) or (
                list(entry.optimizations) if entry else ["eager"]
            )
            duration = request.duration or (entry.duration_seconds if entry else 20.0)
            for precision in precisions:
                for optimization in optimizations:
                    specs.append(
                        ProbeSpec(workload, precision, optimization, duration, device, request.size)
                    )
    return specs


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


def run_json(run: ProbeRun, ratio: float | None) -> dict[str, Any]:
    return {
        "id": run.id,
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
        "manifest": run.manifest,
        "result": run.result,
        "exit_code": run.exit_code,
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


def run_probes(settings: Settings, request: Request, as_json: bool) -> int:
    runner = ProbeRunner(
        python=settings.probing.python,
        startup_timeout_seconds=settings.probing.startup_timeout_seconds,
    )
    store = _discover(settings, runner)
    specs = _specs(settings, request, _devices(store, request.device))
    scheduler = ProbeScheduler(
        settings.probing, runner, store, TelemetryCapture(), (), settings.sampler.interval_seconds
    )
    err = Console(stderr=True)
    runs: list[ProbeRun] = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
        console=err,
        transient=as_json,
    ) as progress:
        for spec in specs:
            feed = _ProgressFeed(progress, spec)
            reason = None if request.force else scheduler.skip_reason(spec)
            if reason is not None:
                now = time.time()
                run = ProbeRun("-", spec, "skipped", reason, now, now)
            else:
                run = runner.run(spec, on_iteration=feed)
            progress.update(feed.task, completed=spec.duration_seconds, status=run.outcome)
            runs.append(run)
    ratios = ratios_to_best(runs)
    if as_json:
        json.dump(
            {"runs": [run_json(run, ratios.get(run.id)) for run in runs]}, sys.stdout, indent=2
        )
        sys.stdout.write("\n")
    else:
        _print_table(runs, ratios)
    return 0 if all(run.outcome in ("ok", "unsupported", "skipped") for run in runs) else 1


def _print_table(runs: Sequence[ProbeRun], ratios: dict[str, float]) -> None:
    table = Table(title="sustain probe results")
    for column in (
        "workload",
        "precision",
        "opt",
        "device",
        "outcome",
        "throughput",
        "vs best",
        "iterations",
        "reason",
    ):
        table.add_column(column)
    for run in runs:
        unit = str((run.manifest or {}).get("unit", ""))
        ratio = ratios.get(run.id)
        table.add_row(
            run.spec.workload,
            run.spec.precision,
            run.spec.optimization,
            run.spec.device.label,
            run.outcome,
            _human(run.throughput, unit),
            "-" if ratio is None else f"{ratio:.3g}",
            str(len(run.iterations)),
            run.reason,
        )
    Console().print(table)
