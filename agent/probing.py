"""Scheduling probes without getting in the way of production.

The plan in the configuration becomes one APScheduler job per entry (an interval or a crontab,
with jitter so that a fleet does not probe in step). Before each run the scheduler checks, per
device: the duty-cycle budget (probe time over the last hour), foreign compute processes on the
GPU, and the device's utilization over the last minute (its own probes' windows excluded); any of
them skips the run, recorded with the reason. Probes on one device never overlap (a lock per
device). While a probe runs, the sampler loops poll at the fast interval and the samples of the
probe's devices are captured under the probe's id, so that the analysis reads the telemetry of
exactly that window.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Protocol

from apscheduler.schedulers.base import BaseScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

from agent.archive.database import ArchiveError
from agent.buffers import TelemetryStore
from agent.config import ProbePlanEntry, ProbingSection
from agent.probe_analysis import AnalysisError, RunAnalysis, analyze_run
from agent.probes import CPU, ProbeDevice, ProbeRun, ProbeRunner, ProbeSpec, skipped
from agent.sampler import SamplerLoop
from collectors.base import Sample

log = logging.getLogger(__name__)

DUTY_WINDOW_SECONDS = 3600.0
BUSY_WINDOW_SECONDS = 60.0
LATENCY_QUANTILES = {"p50": "0.5", "p90": "0.9", "p99": "0.99"}
CAPTURE_LIMIT = 200_000  # samples per probe: 10 Hz x 9 GPUs + host for over half an hour


class TelemetryCapture:
    """A sampler sink that keeps, per running probe, the samples of that probe's devices."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[str, tuple[frozenset[str], list[Sample]]] = {}

    def start(self, probe_id: str, devices: Iterable[str]) -> None:
        with self._lock:
            self._active[probe_id] = (frozenset(devices), [])

    def stop(self, probe_id: str) -> list[Sample]:
        with self._lock:
            _, samples = self._active.pop(probe_id, (frozenset(), []))
            return samples

    def record(self, sample: Sample) -> None:
        with self._lock:
            for devices, samples in self._active.values():
                if sample.device in devices and len(samples) < CAPTURE_LIMIT:
                    samples.append(sample)


def gpu_devices(store: TelemetryStore) -> list[ProbeDevice]:
    """The healthy GPUs the NVML collector reports, in index order."""
    found = []
    for sample in store.latest():
        if sample.collector != "nvml" or sample.device == "system":
            continue
        labels = {}
        healthy = False
        for reading in sample.readings:
            if reading.field == "gpu_healthy":
                labels = dict(reading.labels)
                healthy = reading.value == 1.0
        if healthy and "device" in labels:
            index = int(labels["device"])
            found.append(ProbeDevice("cuda", sample.device, labels["device"], index))
    return sorted(found, key=lambda device: device.index or 0)


class ProbeArchive(Protocol):
    """Where runs are recorded: the spooled sink in the daemon, a direct writer in tools."""

    def start(self, run_id: str, spec: ProbeSpec, started_at: float) -> None: ...

    def finish(
        self, run: ProbeRun, *, analysis: RunAnalysis | None = None, stack_id: str | None = None
    ) -> None: ...


class StackSource(Protocol):
    def after_run(self, run: ProbeRun) -> str: ...


ProbeKey = tuple[str, str, str, str, str]  # workload, precision, optimization, device, uuid


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """The latest analysed result of one probe, for the exporter."""

    unit: str
    work_unit: str
    analysis: RunAnalysis
    latency_seconds: dict[str, float] = field(default_factory=dict)  # p50, p90, p99 (inference)


@dataclass(frozen=True, slots=True)
class ProbeStatus:
    """What the exporter shows of probing."""

    runs: dict[tuple[str, str, str, str, str, str], int]  # ProbeKey + outcome
    last_run: dict[ProbeKey, float]
    running: dict[tuple[str, str], bool]
    duty_used: dict[tuple[str, str], float]
    results: dict[ProbeKey, ProbeResult]


def _device_labels(device: ProbeDevice) -> tuple[str, str]:
    return device.label, device.key if device.kind == "cuda" else ""


class ProbeScheduler:
    """Runs the probe plan: checks, device locks, fast sampling, capture, archive, counters."""

    def __init__(  # noqa: PLR0917 - the agent wires these once
        self,
        settings: ProbingSection,
        runner: ProbeRunner,
        store: TelemetryStore,
        capture: TelemetryCapture,
        loops: Sequence[SamplerLoop],
        baseline_interval: float,
        writer: ProbeArchive | None = None,
        stacks: StackSource | None = None,
    ) -> None:
        self.settings = settings
        self.runner = runner
        self._store = store
        self._capture = capture
        self._loops = loops
        self._baseline_interval = baseline_interval
        self._writer = writer
        self._stacks = stacks
        self._lock = threading.Lock()
        self._device_locks: dict[str, threading.Lock] = {}
        self._history: dict[str, deque[tuple[float, float]]] = {}
        self._fast_users = 0
        self._runs: Counter[tuple[str, str, str, str, str, str]] = Counter()
        self._last_run: dict[ProbeKey, float] = {}
        self._results: dict[ProbeKey, ProbeResult] = {}
        self._running: dict[tuple[str, str], bool] = {}
        self._stopping = threading.Event()

    def devices(self) -> list[ProbeDevice]:
        return gpu_devices(self._store) or [CPU]

    def schedule(self, scheduler: BaseScheduler) -> None:
        first = time.time() + self.settings.initial_delay_seconds
        for position, entry in enumerate(self.settings.plan):
            trigger: IntervalTrigger | CronTrigger
            if entry.cron is not None:
                trigger = CronTrigger.from_crontab(entry.cron, timezone="UTC")
                trigger.jitter = int(entry.jitter_seconds) or None
                next_run = None
            else:
                assert entry.interval_seconds is not None
                trigger = IntervalTrigger(
                    seconds=entry.interval_seconds,
                    jitter=int(entry.jitter_seconds) or None,
                    timezone="UTC",
                )
                next_run = first + random.uniform(0, entry.jitter_seconds)  # noqa: S311
            scheduler.add_job(
                self.run_entry,
                trigger,
                args=(entry,),
                id=f"probe-{position}-{entry.workload}",
                max_instances=1,
                coalesce=True,
                misfire_grace_time=None,
                **(
                    {}
                    if next_run is None
                    else {"next_run_time": datetime.fromtimestamp(next_run, UTC)}
                ),
            )

    def run_entry(self, entry: ProbePlanEntry) -> list[ProbeRun]:
        runs: list[ProbeRun] = []
        for device in self.devices():
            for precision in entry.precisions:
                for optimization in entry.optimizations:
                    if self._stopping.is_set():
                        return runs
                    spec = ProbeSpec(
                        entry.workload,
                        precision,
                        optimization,
                        entry.duration_seconds,
                        device,
                        None if entry.size == "default" else entry.size,
                    )
                    runs.append(self.run_one(spec))
        return runs

    def run_one(
        self,
        spec: ProbeSpec,
        force: bool = False,
        command: Sequence[str] | None = None,
    ) -> ProbeRun:
        """Run one probe now (after the checks, unless ``force``), and record it."""
        with self._device_lock(spec.device.key):
            reason = None if force else self.skip_reason(spec)
            if reason is not None:
                run = skipped(spec, reason)
                log.info("probe %s skipped: %s", spec.name, reason)
                self._record(run)
                return run
            run_id = self._begin(spec)
            try:
                run = self.runner.run(spec, command=command, run_id=run_id)
            finally:
                telemetry = self._end(spec, run_id)
            run = replace(run, telemetry=tuple(telemetry))
            analysis = self._analyze(run)
            stack_id = None
            if self._stacks is not None and run.outcome != "skipped":
                try:
                    stack_id = self._stacks.after_run(run)
                except Exception:  # a stack that cannot be read must not lose the result
                    log.exception("probe %s: the stack could not be read", spec.name)
            self._record(run, analysis=analysis, stack_id=stack_id)
            # Logged once recorded (spooled, durable): a finished run in the log is in the archive.
            if run.outcome not in ("ok", "unsupported"):
                log.warning("probe %s %s: %s", spec.name, run.outcome, run.reason)
            else:
                log.info(
                    "probe %s %s: %d iterations, %s telemetry samples",
                    spec.name,
                    run.outcome,
                    len(run.iterations),
                    len(telemetry),
                )
            return run

    def _analyze(self, run: ProbeRun) -> RunAnalysis | None:
        if run.outcome != "ok" or not run.iterations:
            return None
        try:
            analysis = analyze_run(run, self.runner.python, self.settings.tolerance)
        except AnalysisError as exc:
            log.error("probe %s not analysed: %s", run.spec.name, exc)
            return None
        figures = analysis.figures
        log.info(
            "probe %s: %s, peak %.4g, steady %s, cause %s",
            run.spec.name,
            figures.get("classification"),
            figures.get("peak_throughput") or 0.0,
            "-"
            if figures.get("steady_throughput") is None
            else f"{figures['steady_throughput']:.4g}",
            analysis.attribution.cause or "-",
        )
        return analysis

    def skip_reason(self, spec: ProbeSpec) -> str | None:
        device = spec.device
        now = time.time()
        used = self.duty_used(device.key, now)
        budget = self.settings.duty_cycle * DUTY_WINDOW_SECONDS
        if used + spec.duration_seconds > budget:
            return (
                f"duty cycle: {used:.0f} s of {budget:.0f} s used on {device.label} in the last "
                f"hour, {spec.duration_seconds:g} s more would exceed "
                f"{self.settings.duty_cycle:.1%}"
            )
        if device.kind == "cuda":
            if self.settings.skip_foreign_processes:
                foreign = self._latest_value(device, "gpu_foreign_compute_processes")
                if foreign:
                    return f"{int(foreign)} foreign compute process(es) on GPU {device.label}"
            busy = self._busy_mean(device, "gpu_utilization_ratio", now)
            if busy is not None and busy > self.settings.busy_gpu_utilization:
                return (
                    f"GPU {device.label} busy: mean utilization {busy:.0%} over the last minute "
                    f"(threshold {self.settings.busy_gpu_utilization:.0%})"
                )
        else:
            busy = self._busy_mean(device, "cpu_utilization_ratio", now)
            if busy is not None and busy > self.settings.busy_cpu_utilization:
                return (
                    f"CPU busy: mean utilization {busy:.0%} over the last minute "
                    f"(threshold {self.settings.busy_cpu_utilization:.0%})"
                )
        return None

    def duty_used(self, device_key: str, now: float) -> float:
        since = now - DUTY_WINDOW_SECONDS
        with self._lock:
            history = self._history.get(device_key, deque())
            return sum(max(0.0, end - max(start, since)) for start, end in history if end > since)

    def _latest_value(self, device: ProbeDevice, field: str) -> float | None:
        for sample in self._store.latest():
            if sample.device == device.key:
                for reading in sample.readings:
                    if reading.field == field:
                        return reading.value
        return None

    def _busy_mean(self, device: ProbeDevice, field: str, now: float) -> float | None:
        collector, labels = (
            ("nvml", (("device", device.label), ("uuid", device.key)))
            if device.kind == "cuda"
            else ("host", ())
        )
        points = self._store.points(
            (collector, device.key, field, labels), now - BUSY_WINDOW_SECONDS
        )
        with self._lock:
            own = list(self._history.get(device.key, ()))
        # Our own probes' windows (and a second after each) are not production load.
        values = [
            value
            for timestamp, value in points
            if not any(start <= timestamp <= end + 1.0 for start, end in own)
        ]
        return sum(values) / len(values) if values else None

    def _device_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._device_locks.setdefault(key, threading.Lock())

    def _begin(self, spec: ProbeSpec) -> str:
        probe = skipped(spec, "")  # only for a fresh id and the start time
        with self._lock:
            self._fast_users += 1
            if self._fast_users == 1:
                for loop in self._loops:
                    loop.set_interval(self.settings.fast_interval_seconds)
            self._running[_device_labels(spec.device)] = True
        self._capture.start(probe.id, {spec.device.key})
        if self._writer is not None:
            try:
                self._writer.start(probe.id, spec, probe.started_at)
            except ArchiveError as exc:
                log.error("probe %s: %s", spec.name, exc)
        return probe.id

    def _end(self, spec: ProbeSpec, run_id: str) -> list[Sample]:
        telemetry = self._capture.stop(run_id)
        with self._lock:
            self._fast_users -= 1
            if self._fast_users == 0:
                for loop in self._loops:
                    loop.set_interval(self._baseline_interval)
            self._running[_device_labels(spec.device)] = False
        return telemetry

    def _record(
        self,
        run: ProbeRun,
        *,
        analysis: RunAnalysis | None = None,
        stack_id: str | None = None,
    ) -> None:
        spec = run.spec
        device, uuid = _device_labels(spec.device)
        key = (spec.workload, spec.precision, spec.optimization, device, uuid)
        with self._lock:
            self._runs[(*key, run.outcome)] += 1
            if analysis is not None:
                manifest = run.manifest or {}
                latency = (run.result or {}).get("latency_seconds") or {}
                self._results[key] = ProbeResult(
                    unit=str(manifest.get("unit", "")),
                    work_unit=str(manifest.get("work_unit", "")),
                    analysis=analysis,
                    latency_seconds={
                        name: float(value)
                        for name, value in latency.items()
                        if name in LATENCY_QUANTILES and isinstance(value, int | float)
                    },
                )
            if run.outcome != "skipped":
                self._last_run[key] = run.ended_at
                history = self._history.setdefault(spec.device.key, deque())
                history.append((run.started_at, run.ended_at))
                while history and history[0][1] < run.ended_at - DUTY_WINDOW_SECONDS:
                    history.popleft()
        if self._writer is not None:
            try:
                self._writer.finish(run, analysis=analysis, stack_id=stack_id)
            except ArchiveError as exc:
                log.error("probe %s not archived: %s", spec.name, exc)

    def stop(self) -> None:
        """End the running probes now (the agent is stopping); they are recorded as aborted."""
        self._stopping.set()
        self.runner.stop()

    def status(self) -> ProbeStatus:
        now = time.time()
        with self._lock:
            keys = list(self._history)
            running = dict(self._running)
            runs = dict(self._runs)
            last_run = dict(self._last_run)
            results = dict(self._results)
        duty = {}
        for device in self.devices():
            if device.key in keys or _device_labels(device) in running:
                duty[_device_labels(device)] = self.duty_used(device.key, now) / DUTY_WINDOW_SECONDS
        return ProbeStatus(
            runs=runs, last_run=last_run, running=running, duty_used=duty, results=results
        )
