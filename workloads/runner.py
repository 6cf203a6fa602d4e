"""The iteration loop and the run's three kinds of line: manifest, iterations, result.

Every iteration is emitted, warm-up included: deciding what is warm-up is the analysis's job, and
a series with its first seconds cut off cannot show a warm-up or a slowdown. The stop condition
is checked between iterations only, so a run ends at most one iteration after its duration; the
agent kills a child still running at its duration plus a grace, so the problem is sized before
the manifest to fit the analysis's minimum of iterations (workloads/calibration.py).

Where the run's first iterations show that the size will not reach that minimum after all, the
run re-plans: it shrinks the problem one level and starts its series again, keeping its deadline.
Iterations of different sizes are not comparable and the agent analyses every iteration it
receives, so the first iterations at a size that may still shrink are held back until their pace
is judged (``calibration.checked``): kept, they are emitted then with their own times; dropped,
they never reach the agent as iterations. A second manifest tells it so before any iteration of
the new size: the new size, shapes and parameters, with ``replans`` listing what was dropped.
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from workloads import calibration, facts
from workloads import precision as precisions
from workloads.calibration import calibrate
from workloads.device import DeviceInfo, probe
from workloads.protocol import Emitter, Unsupported
from workloads.timer import Timer, for_device
from workloads.workload import Record, Request, Workload


@dataclass(frozen=True, slots=True)
class Replanning:
    """What a run that may re-plan in flight needs: the minimum of iterations to reach, and
    what takes the smaller workload over (the runner: its manifest, closing it at the end)."""

    min_iterations: int
    on_replan: Callable[[Workload, dict[str, Any]], None]


def run(
    workload_class: type[Workload],
    request: Request,
    device_spec: str,
    *,
    duration: float,
    max_iterations: int | None,
    emitter: Emitter,
    min_iterations: int | None = None,
    neighbours: int = 0,
    cpu_binding: dict[str, Any] | None = None,
    start: Callable[[], bool] | None = None,
) -> None:
    """Run one probe to completion; an Unsupported outcome is a line on stdout, not an error.
    ``cpu_binding`` (workloads.affinity.bind) goes into the manifest as it is. ``start``, where
    given, is called between the manifest and the first iteration and returns whether to go on:
    the start barrier of a node-wide run (the agent releases every device's child at once).
    ``neighbours``: the other children of that run, which sizing leaves room for."""
    try:
        device = probe(device_spec)
        reason = workload_class.unsupported_reason(device, request.precision, request.optimization)
        if reason is not None:
            raise Unsupported(reason)
        if device.kind == "cuda":  # GPU-only: not exercised on CPU
            # CUDA events are recorded on the current device's stream: make it this device.
            torch.cuda.set_device(device.torch_device)
        precisions.configure(request.precision)
        timer = for_device(torch.device(device.torch_device))
        calibrated = calibrate(
            workload_class,
            request,
            device,
            timer,
            duration=duration,
            min_iterations=min_iterations,
            neighbours=neighbours,
        )
    except Unsupported as exc:
        emitter.emit(_unsupported(workload_class, request, device_spec, exc))
        return
    workload = calibrated.workload
    line = manifest(workload, timer, duration, max_iterations)
    native_reason = precisions.native_reason(request.precision, device)
    line.update(
        min_iterations=min_iterations,
        fit=calibrated.fit,
        native=native_reason is None,
        native_reason=native_reason,
        reference=calibrated.reference,
        slow_path=calibrated.slow_path,
        cpu_binding=cpu_binding,
        replans=[],
    )
    emitter.emit(line)
    if start is not None and not start():
        workload.close()
        return

    def on_replan(smaller: Workload, replan: dict[str, Any]) -> None:
        """The run goes on with ``smaller``: its manifest, that of the run (its start, sizing
        and findings) with the new problem and this re-plan added."""
        nonlocal workload
        workload = smaller
        started = line["started"]
        line.update(manifest(smaller, timer, duration, max_iterations), started=started)
        line["replans"].append(replan)
        emitter.emit(line)

    def on_record(index: int, record: Record) -> None:
        line: dict[str, Any] = {
            "event": "iteration",
            "index": index,
            "start": record.start,
            "end": record.end,
            "work": record.work,
        }
        if record.phase is not None:
            line["phase"] = record.phase
        emitter.emit(line)

    try:
        records = iterate(
            workload,
            timer,
            duration,
            max_iterations,
            on_record,
            replanning=None if min_iterations is None else Replanning(min_iterations, on_replan),
        )
    finally:
        workload.close()
    emitter.emit(result(workload, records))


def iterate(
    workload: Workload,
    timer: Timer,
    duration: float,
    max_iterations: int | None,
    on_record: Callable[[int, Record], None],
    *,
    replanning: Replanning | None = None,
) -> list[Record]:
    """Time steps until the duration or the iteration cap is reached (at least one iteration).

    With ``replanning``, a workload that can still shrink holds its first iterations back until
    ``calibration.checked``; where their pace does not reach the minimum by the deadline, they
    are dropped, ``on_replan`` gets the next smaller workload (from then on the caller's to
    close) and what to record, this one is closed, and the series starts again from index 0
    after one untimed step (first calls choose kernels and allocate)."""
    records: list[Record] = []
    steps = workload.steps()
    began = timer.now()
    deadline = began + duration
    holding = replanning is not None and _may_shrink(workload)
    while True:
        done = max_iterations is not None and len(records) >= max_iterations
        done = done or (bool(records) and timer.now() - began >= duration)
        if workload.agree_stop(done):
            break
        step = next(steps)
        start, end = timer.measure(step.run)
        record = Record(start=start, end=end, work=step.work, phase=step.phase)
        records.append(record)
        if replanning is None or not holding:
            on_record(len(records) - 1, record)
            continue
        minimum = replanning.min_iterations
        if not calibration.checked(records, duration / minimum):
            continue
        now = timer.now()
        replan = calibration.replan(workload, records, now=now, deadline=deadline, minimum=minimum)
        if replan is None:
            holding = False
            for index, kept in enumerate(records):
                on_record(index, kept)
            continue
        smaller = calibration.shrunk(workload)
        steps.close()
        replanning.on_replan(smaller, replan)
        workload.close()
        workload, steps, records = smaller, smaller.steps(), []
        timer.measure(next(steps).run)
        holding = _may_shrink(workload)
    if holding:
        for index, kept in enumerate(records):
            on_record(index, kept)
    steps.close()
    return records


def _may_shrink(workload: Workload) -> bool:
    return workload.request.shrink < workload.max_shrink


def manifest(
    workload: Workload, timer: Timer, duration: float, max_iterations: int | None
) -> dict[str, Any]:
    spec = workload.spec
    return {
        "event": "manifest",
        "workload": spec.name,
        "version": spec.version,
        "unit": spec.unit,
        "work_unit": spec.work_unit,
        "precision": workload.request.precision,
        "optimization": workload.request.optimization,
        "size": workload.request.size_label,
        "device": workload.device.torch_device,
        "device_name": workload.device.name,
        "timer": timer.name,
        "shapes": workload.shapes,
        "parameters": workload.parameters,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "backends": facts.backends(),
        "kernel": workload.kernel,
        "threads": torch.get_num_threads(),
        "duration_target": duration,
        "max_iterations": max_iterations,
        "started": time.time(),
        "pid": os.getpid(),
    }


def result(workload: Workload, records: Sequence[Record]) -> dict[str, Any]:
    """Totals over the timed windows only: time between iterations (a cache flush) is excluded."""
    line: dict[str, Any] = {
        "event": "result",
        "iterations": len(records),
        **_totals(records),
        "elapsed": records[-1].end - records[0].start,
        "kernel": workload.kernel,
    }
    phases = sorted({r.phase for r in records if r.phase is not None})
    if phases:
        line["phases"] = {phase: _phase(workload, phase, records) for phase in phases}
    line.update(workload.summary(records))
    return line


def _phase(workload: Workload, phase: str, records: Sequence[Record]) -> dict[str, Any]:
    chosen = [r for r in records if r.phase == phase]
    return {"iterations": len(chosen), **_totals(chosen), **workload.phase_summary(phase, chosen)}


def _totals(records: Sequence[Record]) -> dict[str, Any]:
    duration = math.fsum(r.end - r.start for r in records)
    work = math.fsum(r.work for r in records)
    return {
        "duration": duration,
        "work": work,
        "throughput": work / duration if duration > 0 else None,
    }


def _unsupported(
    workload_class: type[Workload], request: Request, device_spec: str, exc: Unsupported
) -> dict[str, Any]:
    return {
        "event": "unsupported",
        "reason": exc.reason,
        "workload": workload_class.spec.name,
        "precision": request.precision,
        "optimization": request.optimization,
        "device": device_spec,
    }


def device_or_reason(spec: str) -> tuple[DeviceInfo | None, str | None]:
    try:
        return probe(spec), None
    except Unsupported as exc:
        return None, exc.reason
