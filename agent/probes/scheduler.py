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
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from apscheduler.schedulers.base import BaseScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

from agent.config.names import NODE_WIDE, unsupported_up_front
from agent.config.settings import ProbePlanEntry, ProbingSection
from agent.probes.analysis import AnalysisError, RunAnalysis, analyze_run
from agent.probes.devices import TelemetryCapture, gpu_devices, plan_specs
from agent.probes.node import (
    NODE,
    Coupling,
    coupling_of,
    figures,
    low_runs,
    node_members,
    node_total,
)
from agent.probes.preemption import CpuWatch, GpuWatch
from agent.probes.protocol import Iteration
from agent.probes.runner import (
    CPU,
    ProbeDevice,
    ProbeRun,
    ProbeRunner,
    ProbeSpec,
    Watch,
    skipped,
    unsupported,
)
from agent.probes.skips import SkippedRetry, SkipReason, mig_busy, skip_kind
from agent.probes.status import LatestRun, ProbeKey, ProbeResult, ProbeStatus
from agent.telemetry.sampler import SamplerLoop
from agent.telemetry.store import TelemetryStore
from collectors.base import Sample
from collectors.processes import ProcessCpuMeter

log = logging.getLogger(__name__)

DUTY_WINDOW_SECONDS = 3600.0
BUSY_WINDOW_SECONDS = 60.0
FIRST_POLL_WAIT_SECONDS = 30.0  # NVML's first poll (init, discovery) before the first round
LATENCY_QUANTILES = {"p50": "0.5", "p90": "0.9", "p99": "0.99"}
ATTRIBUTION_SECONDS = 1.0  # how long a busy CPU's processes are watched before the skip names them
TOP_PROCESSES = 3
TOP_MIN_CPUS = 0.05  # below this a process is noise, not who is busy


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
        self,
        run: ProbeRun,
        *,
        analysis: RunAnalysis | None = None,
        stack_id: str | None = None,
        coupling: float | None = None,
    ) -> None: ...


class StackSource(Protocol):
    def after_run(self, run: ProbeRun) -> str: ...


def _device_labels(device: ProbeDevice) -> tuple[str, str]:
    if device.key == NODE:
        return NODE, ""
    return device.label, device.key if device.kind == "cuda" else ""


def _key(spec: ProbeSpec) -> ProbeKey:
    return (spec.workload, spec.precision, spec.optimization, *_device_labels(spec.device))


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
        self._skips: Counter[tuple[str, str, str, str, str, str]] = Counter()  # key + kind
        self._retry: SkippedRetry | None = None  # with a schedule: skipped runs tried again
        self._last_run: dict[ProbeKey, float] = {}
        self._results: dict[ProbeKey, ProbeResult] = {}
        self._latest: dict[ProbeKey, LatestRun] = {}
        self._node_results: dict[ProbeKey, ProbeResult] = {}
        self._coupling: dict[ProbeKey, Coupling] = {}
        self._running: dict[tuple[str, str], bool] = {}
        self._stopping = threading.Event()
        self.sysfs = Path("/sys")  # where node-wide CPU runs find the NUMA nodes
        # Who holds a device (its pods or Slurm jobs, in words; "" if unknown), for skip reasons.
        self.occupants: Callable[[str], str] | None = None
        # Told of every recorded run (run, analysis, stack id), outside the scheduler's lock.
        self.listeners: list[Callable[[ProbeRun, RunAnalysis | None, str | None], None]] = []

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
        self._retry = SkippedRetry(
            scheduler, self.run_one, self.settings.skip_retry_seconds, self._stopping
        )
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
            job_id = f"probe-{position}-{entry.workload}"
            scheduler.add_job(
                self.run_entry,
                trigger,
                args=(entry, job_id),
                id=job_id,
                max_instances=1,
                coalesce=True,
                misfire_grace_time=None,
                **(
                    {}
                    if next_run is None
                    else {"next_run_time": datetime.fromtimestamp(next_run, UTC)}
                ),
            )

    def run_entry(self, entry: ProbePlanEntry, job_id: str | None = None) -> list[ProbeRun]:
        """One round of a plan entry (job ``job_id``), its skips tried again (probes.skips)."""
        runs = self._round(entry)
        if self._retry is not None:
            self._retry.after_round(entry, runs, job_id)
        return runs

    def _round(self, entry: ProbePlanEntry) -> list[ProbeRun]:
        runs: list[ProbeRun] = []
        devices = self.devices()
        members: list[ProbeDevice] = []
        if entry.scope == "node" and entry.workload not in NODE_WIDE:
            members = node_members(devices, self.sysfs)
            if len(members) == 1 and members[0].kind == "cpu":
                log.info(
                    "probe %s: node-wide on a CPU node with one NUMA node is the solo run",
                    entry.workload,
                )
                members = []
            else:
                devices = members[:1]
        for spec in plan_specs(self.settings, entry, devices, self.runner):
            if self._stopping.is_set():
                return runs
            if members:
                runs.extend(self.run_node(spec, members))
            else:
                runs.append(self.run_one(spec))
        return runs

    def run_node(
        self,
        spec: ProbeSpec,
        members: Sequence[ProbeDevice],
        force: bool = False,
        command: Sequence[str] | None = None,
    ) -> list[ProbeRun]:
        """``run_node_analysed``, the runs only."""
        return [run for run, _ in self.run_node_analysed(spec, members, force, command)]

    def couplings(self) -> dict[ProbeKey, Coupling]:
        """The latest coupling ratio of every device (and of the node, device "node")."""
        with self._lock:
            return dict(self._coupling)

    def coupling(self, spec: ProbeSpec) -> Coupling | None:
        """The latest coupling ratio of ``spec``'s device (or the node, device "node")."""
        with self._lock:
            return self._coupling.get(_key(spec))

    def run_node_analysed(
        self,
        spec: ProbeSpec,
        members: Sequence[ProbeDevice],
        force: bool = False,
        command: Sequence[str] | None = None,
    ) -> list[tuple[ProbeRun, RunAnalysis | None]]:
        """Run ``spec`` node-wide: on every one of ``members`` at once (``spec.device`` is
        ignored), then the node as a whole. Every device's run is recorded (scope "node") and
        analysed as a solo run is, and so is the node's sum (device "node", scope
        "node_total"), all under one group id; each device's throughput is set against its
        latest solo result (the coupling ratio). The run needs every device to pass its checks;
        otherwise it is skipped, recorded once for the node with the first reason."""
        node = ProbeDevice(members[0].kind, NODE, NODE, None, members=tuple(members))
        total = replace(spec, device=node, scope="node_total")
        group = uuid.uuid4().hex
        with contextlib.ExitStack() as locks:
            for key in sorted({member.gpu for member in members}):
                locks.enter_context(self._device_lock(key))
            reason = None if force else self.skip_reason(total)
            if reason is not None:
                log.info("probe %s skipped: %s", total.name, reason)
                run = replace(skipped(total, reason), group=group)
                self._record(run)
                return [(run, None)]
            specs = [replace(spec, device=member, scope="node") for member in members]
            run_ids = [self._begin(member) for member in specs]
            try:
                runs = self.runner.run_group(
                    specs, run_ids, watch=None if force else self._watch(total), command=command
                )
            finally:
                captured = [
                    self._end(member, run_id) for member, run_id in zip(specs, run_ids, strict=True)
                ]
        runs = [
            replace(run, telemetry=tuple(samples), group=group)
            for run, samples in zip(runs, captured, strict=True)
        ]
        analyses = [self._analyze(run) for run in runs]
        node_run = node_total(total, group, runs)
        node_analysis = self._analyze(node_run)
        couplings = self._couple(spec, runs, analyses, node_run, node_analysis)
        stack_id = self._stack_after(runs[0]) if runs else None
        for run, analysis in zip(runs, analyses, strict=True):
            coupling = couplings.get(_key(run.spec))
            self._record(
                run,
                analysis=analysis,
                stack_id=stack_id,
                coupling=None if coupling is None else coupling.ratio,
            )
            self._log_outcome(run, len(run.telemetry))
        coupling = couplings.get(_key(total))
        self._record(
            node_run,
            analysis=node_analysis,
            stack_id=stack_id,
            coupling=None if coupling is None else coupling.ratio,
        )
        for probe_key, found in sorted(couplings.items()):
            log.info(
                "probe %s node-wide on %s: coupling %.3f (%s)%s",
                spec.workload,
                probe_key[3],
                found.ratio,
                found.compared,
                "" if found.cause is None else f", {found.cause}: {found.reason}",
            )
        return [*zip(runs, analyses, strict=True), (node_run, node_analysis)]

    def _couple(
        self,
        spec: ProbeSpec,
        runs: Sequence[ProbeRun],
        analyses: Sequence[RunAnalysis | None],
        node_run: ProbeRun,
        node_analysis: RunAnalysis | None,
    ) -> dict[ProbeKey, Coupling]:
        """Each device's coupling ratio against its latest solo result of the same size, and
        the node's (stated where the node's own series was analysed)."""
        size = spec.size or "default"
        with self._lock:
            solo = {key: result for key, result in self._results.items() if result.size == size}
            previous = dict(self._coupling)
        found: dict[ProbeKey, Coupling] = {}
        references: list[float] = []
        for run, analysis in zip(runs, analyses, strict=True):
            key = _key(run.spec)
            reference = solo.get(key)
            if analysis is None or reference is None:
                continue
            coupling = coupling_of(
                analysis,
                reference.analysis,
                run.spec.device.gpu,
                previous.get(key),
                self.settings.coupling_threshold,
            )
            if coupling is not None:
                found[key] = coupling
                references.append(coupling.solo_throughput)
        # The node: its devices' node-wide figures summed over their solo figures summed (the
        # figures each device's own ratio compares; on a CPU node, over the whole CPU's solo).
        node_key = _key(node_run.spec)
        members = list(found.values())
        value: float | None = None
        total: float | None = None
        kinds = {member.compared for member in members}
        if spec.device.kind == "cpu":
            cpu = solo.get((spec.workload, spec.precision, spec.optimization, "cpu", ""))
            compared = (
                None
                if cpu is None or None in analyses
                else figures(
                    [*(a.figures for a in analyses if a is not None), cpu.analysis.figures]
                )
            )
            if compared is not None:
                *own, total = compared[0]
                value, kinds = sum(own), {compared[1]}
        elif members and len(members) == len(runs):
            value = sum(member.node_throughput for member in members)
            total = sum(member.solo_throughput for member in members)
        if node_analysis is not None and value is not None and total:
            ratio = value / total
            found[node_key] = Coupling(
                ratio,
                value,
                total,
                kinds.pop() if len(kinds) == 1 else "mixed",
                None,
                "the devices' node-wide figures summed over their solo figures summed",
                low_runs(ratio, previous.get(node_key), self.settings.coupling_threshold),
            )
        with self._lock:
            self._coupling.update(found)
        return found

    def _stack_after(self, run: ProbeRun) -> str | None:
        if self._stacks is None or run.outcome == "skipped":
            return None
        try:
            return self._stacks.after_run(run)
        except Exception:  # a stack that cannot be read must not lose the result
            log.exception("probe %s: the stack could not be read", run.spec.name)
            return None

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
            if self._stopping.is_set():  # queued behind a run when told to stop: never started
                return skipped(spec, "the agent stopped before the run started"), None
            ended = self._ended_before_start(spec, force)
            if ended is not None:
                log.info("probe %s %s: %s", spec.name, ended.outcome, ended.reason)
                self._record(ended)
                return ended, None
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
            self._record(run, analysis=analysis, stack_id=self._stack_after(run))
            self._log_outcome(run, len(telemetry))
            return run, analysis

    def _ended_before_start(self, spec: ProbeSpec, force: bool) -> ProbeRun | None:
        """A run that ends before any child starts: unsupported where the catalogue knows the
        device cannot run it (checked first: no load or ``force`` makes it runnable), else
        skipped where the device is busy or over its duty cycle, unless ``force``."""
        device = spec.device
        lacks = unsupported_up_front(spec.workload, spec.precision, device.kind, device.capability)
        if lacks is not None:
            return unsupported(spec, lacks)
        reason = None if force else self.skip_reason(spec)
        return None if reason is None else skipped(spec, reason)

    @staticmethod
    def _log_outcome(run: ProbeRun, samples: int) -> None:
        """Logged once recorded (spooled, durable): a finished run in the log is in the
        archive."""
        if run.outcome == "preempted":
            log.info(
                "probe %s %s; %d iterations kept, no figures",
                run.spec.name,
                run.reason,
                len(run.iterations),
            )
        elif run.outcome not in ("ok", "unsupported"):
            log.warning("probe %s %s: %s", run.spec.name, run.outcome, run.reason)
        else:
            log.info(
                "probe %s %s: %d iterations, %s telemetry samples",
                run.spec.name,
                run.outcome,
                len(run.iterations),
                samples,
            )

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

    def skip_reason(self, spec: ProbeSpec) -> SkipReason | None:
        device = spec.device
        now = time.time()
        used = self.duty_used(device.key, now)
        budget = self.settings.duty_cycle * DUTY_WINDOW_SECONDS
        if used + spec.duration_seconds > budget:
            return SkipReason(
                f"duty cycle: {used:.0f} s of {budget:.0f} s used on {device.title} in the last "
                f"hour, {spec.duration_seconds:g} s more would exceed "
                f"{self.settings.duty_cycle:.1%}",
                "duty_cycle",
            )
        if device.members:  # node-wide: every GPU must pass its own checks
            reasons = (self.skip_reason(replace(spec, device=m)) for m in device.members)
            return next((reason for reason in reasons if reason is not None), None)
        if device.kind == "cuda":
            busy_gpu = (
                mig_busy(self._store.latest(), device, self.settings.skip_foreign_processes)
                if device.parent
                else self._gpu_busy(device, now)
            )
            held = self.occupants(device.key) if busy_gpu and self.occupants else ""
            # Who held it goes into the skip's reason in the archive: "which job kept the probe
            # off GPU 3" has an answer later.
            if busy_gpu is None or not held:
                return busy_gpu
            return SkipReason(f"{busy_gpu} (held by {held})", busy_gpu.kind)
        busy = self._busy_mean(device, "cpu_utilization_ratio", now)
        if busy is not None and busy > self.settings.busy_cpu_utilization:
            return SkipReason(
                f"CPU busy: mean utilization {busy:.0%} over the last minute "
                f"(threshold {self.settings.busy_cpu_utilization:.0%})"
                f"{self._busiest_processes()}",
                "cpu_busy",
            )
        return None

    def _gpu_busy(self, device: ProbeDevice, now: float) -> SkipReason | None:
        if self.settings.skip_foreign_processes:
            foreign = self._latest_value(device, "gpu_foreign_compute_processes")
            if foreign:
                return SkipReason(
                    f"{int(foreign)} foreign compute process(es) on GPU {device.label}",
                    "foreign_processes",
                )
        busy = self._busy_mean(device, "gpu_utilization_ratio", now)
        if busy is not None and busy > self.settings.busy_gpu_utilization:
            return SkipReason(
                f"GPU {device.label} busy: mean utilization {busy:.0%} over the last minute "
                f"(threshold {self.settings.busy_gpu_utilization:.0%})",
                "gpu_busy",
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
        """Probe time on the device over the last hour; the runs of a node-wide run that share
        a device (a CPU's NUMA nodes) count once."""
        since = now - DUTY_WINDOW_SECONDS
        with self._lock:
            spans = sorted(
                (max(start, since), end)
                for start, end in self._history.get(device_key, ())
                if end > since
            )
        used, reach = 0.0, since
        for start, end in spans:
            used += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        return used

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
        coupling: float | None = None,
    ) -> None:
        spec = run.spec
        key = _key(spec)
        results = self._results if spec.scope == "device" else self._node_results
        with self._lock:
            self._runs[(*key, run.outcome)] += 1
            if run.outcome == "skipped":
                self._skips[(*key, skip_kind(run.reason))] += 1
            result = None
            if analysis is not None:
                manifest = run.manifest or {}
                latency = (run.result or {}).get("latency_seconds") or {}
                result = results[key] = ProbeResult(
                    unit=str(manifest.get("unit", "")),
                    work_unit=str(manifest.get("work_unit", "")),
                    analysis=analysis,
                    latency_seconds={
                        name: float(value)
                        for name, value in latency.items()
                        if name in LATENCY_QUANTILES and isinstance(value, int | float)
                    },
                    size=spec.size or "default",
                )
            if run.outcome != "skipped":
                if spec.scope == "device":
                    self._latest[key] = LatestRun(
                        run.outcome, run.reason, run.started_at, run.ended_at, result
                    )
                self._last_run[key] = run.ended_at
                history = self._history.setdefault(spec.device.key, deque())
                history.append((run.started_at, run.ended_at))
                while history and history[0][1] < run.ended_at - DUTY_WINDOW_SECONDS:
                    history.popleft()
        if self._writer is not None:
            try:
                self._writer.finish(run, analysis=analysis, stack_id=stack_id, coupling=coupling)
            except RecordError as exc:
                log.error("probe %s not archived: %s", spec.name, exc)
        for listener in self.listeners:
            try:
                listener(run, analysis, stack_id)
            except Exception:  # a listener's bug must not lose the run's record
                log.exception("probe %s: a listener failed", spec.name)

    def restore(self, results: Iterable[tuple[ProbeKey, float, ProbeResult]]) -> int:
        """Take the latest archived result of each probe (key, end time, result) as if it had
        just run, so the probe gauges survive a restart; a probe that already ran here wins."""
        restored = 0
        with self._lock:
            for key, ended_at, result in results:
                if key not in self._results:
                    self._results[key] = result
                    self._last_run.setdefault(key, ended_at)
                    # Its start is not kept with it: what the page shows is its end.
                    self._latest.setdefault(key, LatestRun("ok", "", ended_at, ended_at, result))
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
            skips = dict(self._skips)
            last_run = dict(self._last_run)
            results = dict(self._results)
            latest = dict(self._latest)
            node_results = dict(self._node_results)
            coupling = dict(self._coupling)
        duty = {}
        for device in self.devices():
            if device.key in keys or _device_labels(device) in running:
                duty[_device_labels(device)] = self.duty_used(device.key, now) / DUTY_WINDOW_SECONDS
        return ProbeStatus(
            runs=runs,
            last_run=last_run,
            running=running,
            duty_used=duty,
            results=results,
            node_results=node_results,
            coupling=coupling,
            latest=latest,
            skips=skips,
        )
