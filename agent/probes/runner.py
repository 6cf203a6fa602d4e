"""Running one probe: a `python -m workloads run` child, its JSON lines, its outcome.

The daemon never imports torch; the workload runs in a child process in its own process group,
so a CUDA fault, an OOM or a hang costs that run and nothing else. The child streams one JSON
object per line (manifest, one line per iteration, result or unsupported; workloads/README.md
is the contract), so the iterations of a child that dies are kept. Every run ends with one
outcome: ok, failed (exit code and the last stderr lines), timeout (out of time: the process
group is killed, or too few iterations for a verdict), unsupported (with the child's reason),
preempted (foreign work arrived on the device: the process group is killed at once, the
iterations received kept for inspection, no figure taken from them) or skipped (decided before
starting, elsewhere).

A run is bounded twice. Start-up (imports, allocation, compilation, sizing the problem) lasts
until the child's manifest and may take ``startup_timeout_seconds``; the measured run starts
with the manifest and may take its duration plus a grace (a few seconds, or one iteration's
share of the duration when that is longer), after which the process group is killed, not at the
child's next iteration boundary, with the iterations received so far kept. A run with fewer
iterations than the analysis needs (``agent.verdict.MIN_ITERATIONS``, passed to the child, which
sizes its problem to fit them and records the minimum in its manifest) is a ``timeout``, never
``ok``: its reason says "insufficient", with the iteration time and what would fit. Where the
child finds the precision without native support on the device, or on a slow path (over 20x
slower than the device's best precision for the workload), the reason says so too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import psutil

from agent.config.names import PRECISIONS, cuda_native_reason
from agent.probes.protocol import (
    MAX_LINE_BYTES,
    Iteration,
    LineProtocol,
    analysed_count,
    lines_of,
    one_line,
)
from agent.verdict import MIN_ITERATIONS
from collectors.base import Sample
from collectors.nvml.mig import parse_cpu_list
from collectors.stack import may_hold_secret

log = logging.getLogger(__name__)

Scope = Literal["device", "node", "node_total"]
Outcome = Literal["ok", "failed", "timeout", "unsupported", "skipped", "aborted", "preempted"]
OUTCOMES: tuple[Outcome, ...] = (
    "ok",
    "failed",
    "timeout",
    "unsupported",
    "skipped",
    "aborted",
    "preempted",
)

STDERR_LINES = 20
STDERR_LINE_BYTES = 4096  # of a longer stderr line the tail keeps the start
KILL_GRACE_SECONDS = 2.0
RUN_GRACE_SECONDS = 3.0  # the measured run may overrun its duration by this much
WAIT_STEP_SECONDS = 0.1
# A `python -m workloads list` child that cannot say: it does not start, does not answer in time,
# answers with something that is not JSON, or not the object README.md describes.
_UNREADABLE_LISTING = (
    OSError,
    subprocess.TimeoutExpired,
    ValueError,
    LookupError,
    TypeError,
    AttributeError,
)

# What a probe child inherits from the agent: enough to find CUDA and run torch, nothing else
# (no credentials, no database URLs). Prefixes end with "_".
CHILD_ENV_ALLOW = (
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "TMPDIR",
    "LD_LIBRARY_PATH",
    "PYTHONPATH",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_CORETYPE",
    "OPENBLAS_L2_SIZE",
    "CUDA_",
    "NCCL_",
    "TORCH_",
    "TORCHINDUCTOR_",
    "TRITON_",
    "NVIDIA_",
    "CUDNN_",
    "CUBLAS_",
)


@dataclass(frozen=True, slots=True)
class ProbeDevice:
    """Where a probe runs. ``key`` is the telemetry device it is measured against: the GPU's UUID
    (the NVML collector's sample device) or "host" for the CPU."""

    kind: Literal["cpu", "cuda"]
    key: str
    label: str
    index: int | None = None
    # A MIG device: its GPU's UUID and its GPU instance id. ``key`` is then its own MIG-... UUID.
    parent: str | None = None
    mig: str | None = None
    # The CPUs nearest the GPU (cpulist syntax, "0-23,48-71"): its probe children run on them.
    cpus: str = ""
    # The node as one device (key "node"): these GPUs, all visible to one run (allreduce).
    members: tuple[ProbeDevice, ...] = ()
    # A GPU's CUDA compute capability as NVML states it (a MIG device: its GPU's); None unknown.
    capability: tuple[int, int] | None = None

    @property
    def gpu(self) -> str:
        """The physical device: the parent GPU of a MIG device, else ``key``. Its telemetry
        (clocks, power, throttling) explains the probe; one probe runs on it at a time."""
        return self.parent or self.key

    @property
    def title(self) -> str:
        """How messages name the device: "cpu", "0", "0 MIG 1" (GPU 0, GPU instance 1)."""
        return self.label if self.mig is None else f"{self.label} MIG {self.mig}"

    @property
    def torch_device(self) -> str:
        # CUDA_VISIBLE_DEVICES names the GPU by UUID, so inside the child it is always cuda:0.
        return "cpu" if self.kind == "cpu" else "cuda:0"


CPU = ProbeDevice(kind="cpu", key="host", label="cpu")


@dataclass(frozen=True, slots=True)
class ProbeSpec:
    workload: str
    precision: str
    optimization: str
    duration_seconds: float
    device: ProbeDevice
    size: str | None = None
    # "device": a solo run; "node": part of a node-wide run (every device at once, or the node
    # as one device: allreduce); "node_total": the node-wide run's sum over its devices.
    scope: Scope = "device"

    @property
    def name(self) -> str:
        where = self.device.title
        if self.scope == "node" and not self.device.members:
            where += " (node-wide)"
        return f"{self.workload}/{self.precision}/{self.optimization} on {where}"


@dataclass(frozen=True, slots=True)
class Intruder:
    """Foreign work that arrived on a probe's device while it ran: the probe yields to it.
    ``where`` completes "pid 4242 (python3) ...": "appeared on GPU 1", "used 1.9 of 2 CPUs";
    ``seen_at`` is the Unix time it was seen there."""

    pid: int
    name: str
    where: str
    seen_at: float

    @property
    def reason(self) -> str:
        """ "preempted: pid 4242 (python3) appeared on GPU 1 at 12:00:05 UTC"."""
        at = datetime.fromtimestamp(self.seen_at, UTC).strftime("%H:%M:%S")
        return f"preempted: pid {self.pid} ({self.name}) {self.where} at {at} UTC"


# Polled by the runner while its child runs (every WAIT_STEP_SECONDS): None, or what arrived.
Watch = Callable[[], Intruder | None]
# Where a run was stopped: at the start-up timeout, at its duration and grace, or because
# another child of its node-wide run did not start.
Limit = Literal["startup", "run", "peer"]


class _SharedWatch:
    """One watch for the runs of a group, each polling it from its own thread: asked of the
    underlying watch at most once a step, and once it names an intruder, every run sees it."""

    def __init__(self, watch: Watch) -> None:
        self._watch = watch
        self._lock = threading.Lock()
        self._due = 0.0
        self._intruder: Intruder | None = None

    def __call__(self) -> Intruder | None:
        with self._lock:
            now = time.monotonic()
            if self._intruder is None and now >= self._due:
                self._due = now + WAIT_STEP_SECONDS
                self._intruder = self._watch()
            return self._intruder


@dataclass(frozen=True, slots=True)
class ProbeRun:
    """The record of one run, whatever its outcome."""

    id: str
    spec: ProbeSpec
    outcome: Outcome
    reason: str
    started_at: float
    ended_at: float
    manifest: Mapping[str, Any] | None = None
    result: Mapping[str, Any] | None = None
    iterations: tuple[Iteration, ...] = ()
    exit_code: int | None = None
    stderr_tail: str = ""
    protocol_errors: int = 0
    # The samples of the probe's devices taken while it ran (10 Hz), for the analysis.
    telemetry: tuple[Sample, ...] = ()
    # What a preempted run yielded to.
    preempted_by: Intruder | None = None
    # The node-wide run it was part of (one id for every device's run and the node's sum).
    group: str | None = None

    @property
    def throughput(self) -> float | None:
        """The child's own overall figure (work / duration); the analysis refines it."""
        value = None if self.result is None else self.result.get("throughput")
        return float(value) if isinstance(value, int | float) else None


def skipped(spec: ProbeSpec, reason: str) -> ProbeRun:
    now = time.time()
    return ProbeRun(uuid.uuid4().hex, spec, "skipped", reason, now, now)


def unsupported(spec: ProbeSpec, reason: str) -> ProbeRun:
    """A run the device cannot do at all, known before any child starts."""
    now = time.time()
    return ProbeRun(uuid.uuid4().hex, spec, "unsupported", reason, now, now)


def child_environment(device: ProbeDevice, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allow-listed part of ``base`` (the agent's environment), and the GPU to use.

    A prefix lets through whatever a deployment put under it (``CUDA_API_TOKEN``), so a name
    that reads like a credential is dropped even when allowed, and so is a value holding a URL
    with user information (``scheme://user:password@host``): probe children run torch, compilers
    and user-chosen interpreters, and need neither. NCCL_IB_PKEY is an InfiniBand partition key,
    not a secret, and all-reduce probes on partitioned fabrics need it.
    """
    source = os.environ if base is None else base
    not_credentials = ("NCCL_IB_PKEY",)
    env = {
        name: value
        for name, value in source.items()
        if any(
            name == allowed or (allowed.endswith("_") and name.startswith(allowed))
            for allowed in CHILD_ENV_ALLOW
        )
        and not may_hold_secret(name, value, harmless=not_credentials)
    }
    env["PYTHONUNBUFFERED"] = "1"
    if device.members:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(member.key for member in device.members)
    elif device.kind == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = device.key
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def cuda_lacking(device: ProbeDevice) -> dict[str, str]:
    """The precisions a GPU (every GPU of a node-wide device) runs without native support, by
    compute capability; nothing where a capability is unknown."""
    lacking: dict[str, str] = {}
    for gpu in device.members or (device,):
        if gpu.capability is None:
            continue
        for precision in PRECISIONS:
            why = cuda_native_reason(precision, gpu.capability)
            if why is not None:
                lacking.setdefault(precision, why)
    return lacking


class ProbeRunner:
    """Starts probe children and turns what they do into ``ProbeRun`` records."""

    def __init__(
        self,
        python: str | None = None,
        startup_timeout_seconds: float = 180.0,
        environment: Mapping[str, str] | None = None,
        grace_seconds: float = RUN_GRACE_SECONDS,
    ) -> None:
        self.python = python or sys.executable
        self.startup_timeout_seconds = startup_timeout_seconds
        self.grace_seconds = grace_seconds
        self._environment = environment
        self._lock = threading.Lock()
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._stopping = False
        self._lacking: dict[str, dict[str, str]] = {}  # device key -> precision -> why

    def child_pids(self) -> set[int]:
        """PIDs of running probe children and of every process they started (the ranks of an
        all-reduce): on a GPU they are the agent's, not foreign work."""
        with self._lock:
            pids = set(self._children)
        for pid in list(pids):
            with contextlib.suppress(psutil.Error):
                pids.update(child.pid for child in psutil.Process(pid).children(recursive=True))
        return pids

    def stop(self) -> None:
        """Kill every running child's process group now; their runs end as aborted."""
        with self._lock:
            self._stopping = True
            children = list(self._children.values())
        for process in children:
            self._kill_group(process)

    def lacking_native(self, device: ProbeDevice) -> dict[str, str]:
        """The precisions ``device`` runs without native support, each with why ("bf16 on
        this CPU has no native support (...)"). A GPU's come from its compute capability as NVML
        states it: no child is started and no CUDA context made on a GPU before a probe's checks
        (a production job may hold it, in exclusive-process mode a second context fails its
        own). A CPU's, as `python -m workloads list` says: read once; empty, and read again next
        time, where the child cannot say (nothing is left out on a guess)."""
        if device.kind == "cuda":
            return cuda_lacking(device)
        with self._lock:
            known = self._lacking.get(device.key)
        if known is not None:
            return known
        command = [
            self.python,
            "-m",
            "workloads",
            "list",
            "--json",
            "--device",
            device.torch_device,
        ]
        try:
            done = subprocess.run(
                command,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                env=child_environment(device, self._environment),
                timeout=self.startup_timeout_seconds,
                check=False,
            )
            listing = json.loads(done.stdout)
            lacking = {
                str(name): one_line(entry.get("reason")) or f"{name} has no native support"
                for name, entry in listing["precisions"].items()
                if isinstance(entry, dict) and entry.get("native") is False
            }
        except _UNREADABLE_LISTING as exc:
            log.warning("native precisions of %s unknown: %s", device.label, one_line(exc))
            return {}
        if lacking:
            log.info("%s: %s", device.label, "; ".join(lacking.values()))
        with self._lock:
            self._lacking[device.key] = lacking
        return lacking

    def command(self, spec: ProbeSpec) -> list[str]:
        command = [
            self.python, "-m", "workloads", "run",
            "--workload", spec.workload,
            "--precision", spec.precision,
            "--optimization", spec.optimization,
            "--duration", f"{spec.duration_seconds:g}",
            "--device", spec.device.torch_device,
            "--min-iterations", str(MIN_ITERATIONS),
        ]  # fmt: skip
        if spec.size is not None:
            command += ["--size", spec.size]
        if spec.device.members:  # one rank per GPU; on a CPU (tests) gloo ranks
            command += ["--ranks", str(len(spec.device.members))]
        if spec.device.cpus:
            cpus = sorted(parse_cpu_list(spec.device.cpus))
            command += ["--cpus", ",".join(map(str, cpus))]
        return command

    def grace(self, duration: float) -> float:
        """How long the measured run may overrun ``duration``: a few seconds, or one
        iteration's share of it where that is longer."""
        return max(self.grace_seconds, duration / MIN_ITERATIONS)

    def run(
        self,
        spec: ProbeSpec,
        on_iteration: Callable[[Iteration], None] | None = None,
        command: Sequence[str] | None = None,
        run_id: str | None = None,
        watch: Watch | None = None,
        *,
        start: threading.Barrier | None = None,
    ) -> ProbeRun:
        """Run ``spec`` to its end, or until ``watch`` names foreign work on its device (then the
        process group is killed at once and the run is ``preempted``); ``command`` replaces the
        workload command (tests use it to start children that crash, raise or hang). With
        ``start``, the child waits after its manifest until every party of the barrier has sent
        its own (``run_group``)."""
        run_id = run_id or uuid.uuid4().hex
        protocol = LineProtocol(on_iteration)
        protocol.gated = start is not None
        stderr_tail: deque[str] = deque(maxlen=STDERR_LINES)
        started = time.time()
        try:
            process = subprocess.Popen(
                self._argv(spec, command, start),
                stdin=subprocess.DEVNULL if start is None else subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=child_environment(spec.device, self._environment),
                start_new_session=True,  # its own process group, killed as a whole
            )
        except OSError as exc:
            if start is not None:
                start.abort()
            return ProbeRun(
                run_id, spec, "failed", f"cannot start the probe: {exc}", started, time.time()
            )
        with self._lock:
            self._children[process.pid] = process
            stopping = self._stopping
        if stopping:
            self._kill_group(process)
        readers = self._readers(process, protocol, stderr_tail, start)
        for reader in readers:
            reader.start()
        limit: Limit | Intruder | None = None
        try:
            limit = self._wait(process, protocol, spec.duration_seconds, watch, start)
            if isinstance(limit, Intruder):
                self._kill_group(process, (signal.SIGKILL,))  # production waits for the device
            elif limit is not None:
                self._kill_group(process)
        finally:
            for reader in readers:
                reader.join(5)
            with self._lock:
                self._children.pop(process.pid, None)
                stopping = self._stopping
        ended = time.time()
        outcome: Outcome
        if stopping:
            outcome, reason = "aborted", "the agent stopped during the run"
        elif isinstance(limit, Intruder):
            outcome, reason = "preempted", limit.reason
        else:
            outcome, reason = self._outcome(spec, process.returncode, limit, protocol, stderr_tail)
        return ProbeRun(
            id=run_id,
            spec=spec,
            outcome=outcome,
            reason=reason,
            started_at=started,
            ended_at=ended,
            manifest=protocol.manifest,
            result=protocol.result,
            iterations=tuple(protocol.iterations),
            exit_code=None if limit is not None else process.returncode,
            stderr_tail="\n".join(stderr_tail),
            protocol_errors=protocol.errors,
            preempted_by=limit if isinstance(limit, Intruder) else None,
        )

    def _argv(
        self, spec: ProbeSpec, command: Sequence[str] | None, start: threading.Barrier | None
    ) -> list[str]:
        if command is not None:
            return list(command)
        if start is None:
            return self.command(spec)
        # Sized for the neighbours it will be measured beside (workloads/calibration.py).
        return [*self.command(spec), "--start-on-stdin", "--neighbours", str(start.parties - 1)]

    def _readers(
        self,
        process: subprocess.Popen[bytes],
        protocol: LineProtocol,
        stderr_tail: deque[str],
        start: threading.Barrier | None,
    ) -> list[threading.Thread]:
        """The threads that follow a child: its stdout, its stderr, and its start barrier."""
        readers = [
            threading.Thread(target=self._read_stdout, args=(process, protocol), daemon=True),
            threading.Thread(target=self._read_stderr, args=(process, stderr_tail), daemon=True),
        ]
        if start is not None:
            readers.append(
                threading.Thread(target=self._release, args=(process, protocol, start), daemon=True)
            )
        return readers

    def run_group(
        self,
        specs: Sequence[ProbeSpec],
        run_ids: Sequence[str],
        watch: Watch | None = None,
        command: Sequence[str] | None = None,
    ) -> list[ProbeRun]:
        """Run ``specs`` at once, one child each, behind a start barrier: every child sizes and
        warms its problem, and all are released together once the last has sent its manifest,
        so their measured runs overlap. A child that cannot start, or dies before its manifest,
        breaks the barrier and the others are stopped (``failed``, "did not start"). Foreign
        work seen by ``watch`` preempts every run of the group."""
        barrier = threading.Barrier(len(specs))
        shared = None if watch is None else _SharedWatch(watch)
        runs: list[ProbeRun | None] = [None] * len(specs)

        def one(position: int) -> None:
            runs[position] = self.run(
                specs[position],
                command=command,
                run_id=run_ids[position],
                watch=shared,
                start=barrier,
            )

        threads = [
            threading.Thread(target=one, args=(position,), name=f"probe-{position}", daemon=True)
            for position in range(len(specs))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return [run for run in runs if run is not None]

    def _release(
        self, process: subprocess.Popen[bytes], protocol: LineProtocol, start: threading.Barrier
    ) -> None:
        """Wait at ``start`` once the child has sent its manifest, then let it measure. A child
        that exits, or sends nothing within the start-up timeout, breaks the barrier for all."""
        deadline = time.monotonic() + self.startup_timeout_seconds
        while not protocol.manifest_seen.wait(WAIT_STEP_SECONDS):
            if process.poll() is not None or time.monotonic() >= deadline:
                start.abort()
                return
        try:
            start.wait(max(0.0, deadline - time.monotonic()))
        except threading.BrokenBarrierError:
            return
        protocol.measuring_since = time.monotonic()
        assert process.stdin is not None
        with contextlib.suppress(OSError):  # a child gone meanwhile ends by itself
            process.stdin.write(b"go\n")
            process.stdin.close()

    def _wait(
        self,
        process: subprocess.Popen[bytes],
        protocol: LineProtocol,
        duration: float,
        watch: Watch | None,
        start: threading.Barrier | None = None,
    ) -> Limit | Intruder | None:
        """Wait for the child to exit: until its manifest (its release, behind a start barrier)
        at most the start-up timeout, from then on its duration and the grace, asking ``watch``
        every step whether foreign work arrived. The limit it ran into, the intruder, or None."""
        startup_deadline = time.monotonic() + self.startup_timeout_seconds
        while True:
            intruder = None if watch is None else watch()
            if intruder is not None:
                return intruder
            since = protocol.measuring_since
            if since is None and start is not None and start.broken:
                return "peer"
            if since is None:
                limit: Limit = "startup"
                deadline = startup_deadline
            else:
                limit, deadline = "run", since + duration + self.grace(duration)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return limit
            try:
                process.wait(timeout=min(remaining, WAIT_STEP_SECONDS))
            except subprocess.TimeoutExpired:
                continue
            return None

    @staticmethod
    def _read_stdout(process: subprocess.Popen[bytes], protocol: LineProtocol) -> None:
        assert process.stdout is not None
        for raw in lines_of(process.stdout, MAX_LINE_BYTES):
            protocol.feed(raw)

    @staticmethod
    def _read_stderr(process: subprocess.Popen[bytes], tail: deque[str]) -> None:
        assert process.stderr is not None
        for raw in lines_of(process.stderr, STDERR_LINE_BYTES):
            line = raw.decode(errors="replace").rstrip()
            if line:
                tail.append(line[:500])

    @staticmethod
    def _kill_group(
        process: subprocess.Popen[bytes],
        signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGKILL),
    ) -> None:
        """SIGTERM to the whole group, SIGKILL after a grace period: a hung CUDA call may not
        answer SIGTERM, and the child's own children (compile workers) must go too. A preempted
        run's group gets SIGKILL alone: the device is wanted now."""
        for sig in signals:
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            try:
                process.wait(timeout=KILL_GRACE_SECONDS)
                if sig == signal.SIGTERM:
                    os.killpg(process.pid, signal.SIGKILL)  # leftovers in the group
                return
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                return

    def _outcome(
        self,
        spec: ProbeSpec,
        code: int | None,
        limit: Limit | None,
        protocol: LineProtocol,
        stderr_tail: deque[str],
    ) -> tuple[Outcome, str]:
        outcome: Outcome
        if limit is not None:
            outcome = "failed" if limit == "peer" else "timeout"
            reason = self._stopped(spec, limit, protocol)
        else:
            outcome, reason = self._exit(code, protocol, stderr_tail)
            declared = (protocol.manifest or {}).get("min_iterations")
            if (
                outcome == "ok"
                and isinstance(declared, int)
                and analysed_count(protocol.iterations) < declared
            ):
                outcome, reason = "timeout", self._insufficient(spec, protocol, declared)
        finding = precision_finding(protocol.manifest) if outcome in ("ok", "timeout") else ""
        return outcome, "; ".join(part for part in (reason, finding) if part)

    @staticmethod
    def _exit(
        code: int | None, protocol: LineProtocol, stderr_tail: deque[str]
    ) -> tuple[Outcome, str]:
        """The outcome of a child that exited by itself."""
        last = stderr_tail[-1] if stderr_tail else "no error output"
        if code is not None and code < 0:
            return "failed", f"killed by {signal.Signals(-code).name}: {last}"
        if code:
            return "failed", f"exit code {code}: {last}"
        if protocol.unsupported is not None:
            return "unsupported", protocol.unsupported
        if protocol.result is None:
            return "failed", "exited without a result line"
        return "ok", ""

    def _stopped(self, spec: ProbeSpec, limit: Limit, protocol: LineProtocol) -> str:
        """Why a child was killed at a limit, and what it had delivered."""
        killed = f"process group killed after {len(protocol.iterations)} iterations"
        if limit == "peer":
            return f"node-wide start: another device's probe did not start; {killed}"
        if limit == "startup":
            return (
                f"no manifest within the start-up timeout of {self.startup_timeout_seconds:g} s; "
                f"{killed}"
            )
        duration = spec.duration_seconds
        stopped = f"stopped at {duration:g} s + {self.grace(duration):g} s grace"
        declared = (protocol.manifest or {}).get("min_iterations")
        minimum = declared if isinstance(declared, int) else MIN_ITERATIONS
        if analysed_count(protocol.iterations) >= minimum:
            return f"{stopped} in an iteration still running; {killed}"
        return f"{self._insufficient(spec, protocol, minimum)} ({stopped}; {killed})"

    def _insufficient(self, spec: ProbeSpec, protocol: LineProtocol, minimum: int) -> str:
        """ "insufficient: 1 iteration of 53 s in 2 s; at least 30 are needed: use --size small
        or a --duration of at least 1590 s"."""
        counts = Counter(iteration.phase for iteration in protocol.iterations)
        phase = counts.most_common(1)[0][0] if counts else None
        times = [i.end - i.start for i in protocol.iterations if i.phase == phase]
        window = f"{spec.duration_seconds:g} s"
        smaller = "" if spec.size == "small" else "--size small or "
        if not times:
            grace = self.grace(spec.duration_seconds)
            done = f"no iteration ended within {window} + {grace:g} s grace"
            longer = "a longer --duration"
        else:
            seconds = math.fsum(times) / len(times)
            plural = "" if len(times) == 1 else "s"
            done = f"{len(times)} iteration{plural} of {seconds:.3g} s in {window}"
            # A phased workload (membw: copy and triad in turn) spends the other phases' time
            # too: the run's span per counted iteration is what a longer run repeats.
            iterations = protocol.iterations
            span = iterations[-1].end - iterations[0].start
            per_counted = max(seconds, span / len(times))
            if len(counts) > 1:
                others = len(iterations) - len(times)
                done = f"{len(times)} {phase} iteration{plural} of {seconds:.3g} s (and {others} "
                done += f"of its other phases) in {window}"
            longer = f"a --duration of at least {math.ceil(minimum * per_counted):d} s"
        return f"insufficient: {done}; at least {minimum} are needed: use {smaller}{longer}"


def precision_finding(manifest: Mapping[str, Any] | None) -> str:
    """What the child found of the precision: a slow path, or no native support (with how it
    compared with the device's native precisions where that was measured)."""
    manifest = manifest or {}
    slow = one_line(manifest.get("slow_path"))
    if slow:
        return f"slow path: {slow}"
    why = one_line(manifest.get("native_reason"))
    if manifest.get("native") is not False or not why:
        return ""
    reference = manifest.get("reference")
    if isinstance(reference, dict):
        ratio, other = reference.get("ratio"), reference.get("precision")
        if (
            isinstance(ratio, int | float)
            and not isinstance(ratio, bool)
            and isinstance(other, str)
        ):
            return f"{why}: {ratio:.3g} of {one_line(other)}"
    return why
