"""Scheduling probes without getting in the way of production.

The plan in the configuration becomes one APScheduler job per entry (an interval or a crontab,
with jitter so that a fleet does not probe in step). Before each run the scheduler checks, per
device: the duty-cycle budget (probe time over the last hour), foreign compute processes on the
GPU, and the device's utilization over the last minute (its own probes' windows excluded); any of
them skips the run, recorded with the reason. Probes on one device never overlap (a lock per
device). While a probe runs, the sampler loops poll at the fast interval and the samples of the
probe's devices are captured under the probe's id, so that the analysis reads the telemetry of
exactly that window. A CPU skipped as busy is explained by the foreign processes that kept it
busy, measured over one second at the time of the skip (collectors/processes.py). A probe that
runs yields to production arriving on its device (agent/probes/preemption.py): it is stopped,
recorded as ``preempted``, its series kept and no figure taken from it.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Protocol

from apscheduler.schedulers.base import BaseScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

from agent.config.names import NODE_WIDE
from agent.config.settings import ProbePlanEntry, ProbingSection
from agent.probes.analysis import AnalysisError, RunAnalysis, analyze_run
from agent.probes.preemption import CpuWatch, GpuWatch
from agent.probes.runner import (
    CPU,
    Iteration,
    ProbeDevice,
    ProbeRun,
    ProbeRunner,
    ProbeSpec,
    Watch,
    skipped,
)
from agent.telemetry.sampler import SamplerLoop
from agent.telemetry.store import TelemetryStore
from collectors.base import Sample
from collectors.nvml.mig import cpu_list, parse_cpu_list
from collectors.processes import ProcessCpuMeter

log = logging.getLogger(__name__)

DUTY_WINDOW_SECONDS = 3600.0
BUSY_WINDOW_SECONDS = 60.0
FIRST_POLL_WAIT_SECONDS = 30.0  # NVML's first poll (init, discovery) before the first round
LATENCY_QUANTILES = {"p50": "0.5", "p90": "0.9", "p99": "0.99"}
CAPTURE_LIMIT = 200_000  # samples per probe: 10 Hz x 9 GPUs + host for over half an hour
ATTRIBUTION_SECONDS = 1.0  # how long a busy CPU's processes are watched before the skip names them
TOP_PROCESSES = 3
TOP_MIN_CPUS = 0.05  # below this a process is noise, not who is busy


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
    """The healthy GPUs the NVML collector reports, in index order. A GPU in MIG mode runs
    nothing by its own UUID: its MIG devices are listed instead (by their MIG-... UUIDs), each
    with the GPU's nearest CPUs."""
    gpus: dict[str, tuple[dict[str, str], str, bool]] = {}  # uuid -> labels, cpus, MIG mode
    instances: list[dict[str, str]] = []
    for sample in store.latest():
        if sample.collector != "nvml" or sample.device == "system":
            continue
        readings = {reading.field: reading for reading in sample.readings}
        if "gpu_mig_info" in readings:
            instances.append(dict(readings["gpu_mig_info"].labels))
            continue
        healthy = readings.get("gpu_healthy")
        if healthy is None or healthy.value != 1.0 or "device" not in dict(healthy.labels):
            continue
        topology = readings.get("gpu_topology_info")
        mode = readings.get("gpu_mig_mode")
        gpus[sample.device] = (
            dict(healthy.labels),
            "" if topology is None else dict(topology.labels).get("cpu_affinity", ""),
            mode is not None and mode.value == 1.0,
        )
    found = [
        ProbeDevice("cuda", uuid, labels["device"], int(labels["device"]), cpus=cpus)
        for uuid, (labels, cpus, mig_mode) in gpus.items()
        if not mig_mode
    ]
    for labels in instances:
        parent = gpus.get(labels["parent"])
        if parent is not None and parent[2]:
            found.append(
                ProbeDevice(
                    "cuda",
                    labels["uuid"],
                    labels["device"],
                    int(labels["device"]),
                    parent=labels["parent"],
                    mig=labels["mig_instance"],
                    cpus=parent[1],
                )
            )
    return sorted(found, key=lambda device: (device.index or 0, int(device.mig or 0)))


def node_device(devices: Sequence[ProbeDevice]) -> ProbeDevice:
    """The node as one device, for a node-wide workload (allreduce): every whole GPU, all
    visible to one run, its children on the union of the GPUs' CPUs. MIG devices are left out
    (CUDA uses one MIG device per process); with fewer than two GPUs the workload says it does
    not apply. A CPU-only node keeps the CPU."""
    gpus = tuple(device for device in devices if device.kind == "cuda" and device.parent is None)
    if not gpus:
        return devices[0] if devices else CPU
    cpus = (
        cpu_list(set().union(*(parse_cpu_list(gpu.cpus) for gpu in gpus)))
        if all(gpu.cpus for gpu in gpus)
        else ""
    )
    return ProbeDevice("cuda", "node", "node", None, cpus=cpus, members=gpus)


def plan_precisions(
    probing: ProbingSection, entry: ProbePlanEntry, runner: ProbeRunner, device: ProbeDevice
) -> list[str]:
    """The precisions of ``entry`` to run on ``device``. A plan the configuration gives runs
    every precision it lists (one the device lacks natively runs too, reported as such); the
    built-in plan leaves out those the device runs without native support (bf16 on a CPU without
    AVX512-BF16 or AMX: orders of magnitude below fp32, it would measure the emulation)."""
    if "plan" in probing.model_fields_set:
        return list(entry.precisions)
    lacking = runner.lacking_native(device)
    return [precision for precision in entry.precisions if precision not in lacking]


class RecordError(Exception):
    """A ``ProbeArchive`` could not record a run; the message is one line.

    The archive sits above the probes, so it raises this error of the probes' own rather than the
    probes importing the archive's: the scheduler logs it and carries on (the run is still
    exported)."""


class ProbeArchive(Protocol):
    """Where runs are recorded: the spooled sink in the daemon, a direct writer in tools. Either
    raises ``RecordError`` when it cannot take the run."""

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
        processes: ProcessCpuMeter | None = None,
    ) -> None:
        self.settings = settings
        self.runner = runner
        self._store = store
        self._capture = capture
        self._loops = loops
        self._baseline_interval = baseline_interval
        self._writer = writer
        self._stacks = stacks
        self._processes = processes
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
        """The GPUs the NVML collector reports, or the CPU where it reports none. Its first poll
        is waited for (up to FIRST_POLL_WAIT_SECONDS): a plan that starts with the agent must
        not take a GPU node for a CPU one because NVML has not answered yet."""
        deadline = time.monotonic() + FIRST_POLL_WAIT_SECONDS
        for loop in self._loops:
            while (
                loop.collector.name == "nvml"
                and loop.status().polls == 0
                and time.monotonic() < deadline
                and not self._stopping.wait(0.05)
            ):
                pass
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
        devices = self.devices()
        if entry.workload in NODE_WIDE:
            devices = [node_device(devices)]
        for device in devices:
            for precision in plan_precisions(self.settings, entry, self.runner, device):
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
        return self.run_analysed(spec, force, command)[0]

    def run_analysed(
        self,
        spec: ProbeSpec,
        force: bool = False,
        command: Sequence[str] | None = None,
        on_iteration: Callable[[Iteration], None] | None = None,
    ) -> tuple[ProbeRun, RunAnalysis | None]:
        """``run_one``, also returning the run's analysis (``sustain probe`` shows it)."""
        with contextlib.ExitStack() as locks:
            for key in sorted({member.gpu for member in spec.device.members} or {spec.device.gpu}):
                locks.enter_context(self._device_lock(key))
            reason = None if force else self.skip_reason(spec)
            if reason is not None:
                run = skipped(spec, reason)
                log.info("probe %s skipped: %s", spec.name, reason)
                self._record(run)
                return run, None
            run_id = self._begin(spec)
            try:
                run = self.runner.run(
                    spec,
                    on_iteration=on_iteration,
                    command=command,
                    run_id=run_id,
                    watch=None if force else self._watch(spec),
                )
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
            if run.outcome == "preempted":
                log.info(
                    "probe %s %s; %d iterations kept, no figures",
                    spec.name,
                    run.reason,
                    len(run.iterations),
                )
            elif run.outcome not in ("ok", "unsupported"):
                log.warning("probe %s %s: %s", spec.name, run.outcome, run.reason)
            else:
                log.info(
                    "probe %s %s: %d iterations, %s telemetry samples",
                    spec.name,
                    run.outcome,
                    len(run.iterations),
                    len(telemetry),
                )
            return run, analysis

    def _watch(self, spec: ProbeSpec) -> Watch | None:
        """What the run yields to (``probing.preempt``): a compute process arriving on its GPU,
        or on the CPU a foreign process above ``preempt_cpu_share`` (measured with a process
        table meter of the run's own, as the busy check's answers a question of its own)."""
        if not self.settings.preempt:
            return None
        if spec.device.kind == "cuda":  # node-wide: every GPU of the run
            return GpuWatch(self._store, spec.device.members or [spec.device])
        if self._processes is None:
            return None
        meter = ProcessCpuMeter(self._processes.procfs)
        return CpuWatch(meter, self.settings.preempt_cpu_share)

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
                f"duty cycle: {used:.0f} s of {budget:.0f} s used on {device.title} in the last "
                f"hour, {spec.duration_seconds:g} s more would exceed "
                f"{self.settings.duty_cycle:.1%}"
            )
        if device.members:  # node-wide: every GPU must pass its own checks
            reasons = (self.skip_reason(replace(spec, device=m)) for m in device.members)
            return next((reason for reason in reasons if reason is not None), None)
        if device.parent is not None:
            return self._mig_busy(device)
        if device.kind == "cuda":
            return self._gpu_busy(device, now)
        busy = self._busy_mean(device, "cpu_utilization_ratio", now)
        if busy is not None and busy > self.settings.busy_cpu_utilization:
            return (
                f"CPU busy: mean utilization {busy:.0%} over the last minute "
                f"(threshold {self.settings.busy_cpu_utilization:.0%})"
                f"{self._busiest_processes()}"
            )
        return None

    def _gpu_busy(self, device: ProbeDevice, now: float) -> str | None:
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
        return None

    def _mig_busy(self, device: ProbeDevice) -> str | None:
        """A MIG GPU is busy when any of its MIG devices has work: its utilization reads N/A,
        so the processes decide, on the GPU's list or, where NVML refuses that one, the
        instances' lists. When neither can be read, whether it is busy cannot be told: skipped,
        saying so, rather than probed blindly."""
        if not self.settings.skip_foreign_processes:
            return None
        gpu = device.gpu
        whole: float | None = None
        instances: dict[str, float | None] = {}
        for sample in self._store.latest():
            for reading in sample.readings:
                labels = dict(reading.labels)
                if sample.device == gpu and reading.field == "gpu_foreign_compute_processes":
                    whole = reading.value
                elif reading.field == "gpu_mig_info" and labels.get("parent") == gpu:
                    instances.setdefault(labels["mig_instance"], None)
                elif reading.field == "gpu_mig_foreign_compute_processes" and (
                    labels.get("parent") == gpu
                ):
                    instances[labels["mig_instance"]] = reading.value
        busy = {gi: int(count) for gi, count in sorted(instances.items()) if count}
        if busy:
            where = ", ".join(f"{count} on MIG {gi}" for gi, count in busy.items())
            return (
                f"{sum(busy.values())} foreign compute process(es) on GPU {device.label} "
                f"(MIG mode: {where})"
            )
        if whole:
            return f"{int(whole)} foreign compute process(es) on GPU {device.label} (MIG mode)"
        if whole is None and (not instances or None in instances.values()):
            return (
                f"GPU {device.label} is in MIG mode, where utilization reads N/A, and NVML "
                "refused its process lists: whether it is busy cannot be told"
            )
        return None

    def _busiest_processes(self) -> str:
        """The tail of a busy CPU's skip reason that names who is busy ("; top: pid 4242
        stress-ng 1.9 CPUs"), or "" when no foreign process stands out.

        Measured now, over ``ATTRIBUTION_SECONDS``: two reads of the process table per skip, so
        nothing is spent on it while the CPU is not busy."""
        if self._processes is None:
            return ""
        self._processes.poll()
        self._stopping.wait(ATTRIBUTION_SECONDS)
        use = self._processes.poll()
        if use is None:
            return ""
        top = [process for process in use.processes if process.cpus >= TOP_MIN_CPUS]
        if not top:
            return ""
        return "; top: " + ", ".join(
            f"pid {process.pid} {process.name or '?'} {process.cpus:.1f} CPUs"
            for process in top[:TOP_PROCESSES]
        )

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
        keys = {spec.device.key, spec.device.gpu, *(m.key for m in spec.device.members)}
        self._capture.start(probe.id, keys)
        if self._writer is not None:
            try:
                self._writer.start(probe.id, spec, probe.started_at)
            except RecordError as exc:
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
            except RecordError as exc:
                log.error("probe %s not archived: %s", spec.name, exc)

    def restore(self, results: Iterable[tuple[ProbeKey, float, ProbeResult]]) -> int:
        """Take the latest archived result of each probe (key, end time, result) as if it had
        just run, so the probe gauges survive a restart; a probe that already ran here wins."""
        restored = 0
        with self._lock:
            for key, ended_at, result in results:
                if key not in self._results:
                    self._results[key] = result
                    self._last_run.setdefault(key, ended_at)
                    restored += 1
        return restored

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
