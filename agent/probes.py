"""Running one probe: a `python -m workloads run` child, its JSON lines, its outcome.

The daemon never imports torch; the workload runs in a child process in its own process group,
so a CUDA fault, an OOM or a hang costs that run and nothing else. The child streams one JSON
object per line (manifest, one line per iteration, result or unsupported; workloads/README.md
is the contract), so the iterations of a child that dies are kept. Every run ends with one
outcome: ok, failed (exit code and the last stderr lines), timeout (the process group is
killed), unsupported (with the child's reason) or skipped (decided before starting, elsewhere).
"""

from __future__ import annotations

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
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, Literal, NoReturn

from collectors.base import Sample
from collectors.stack import may_hold_secret

log = logging.getLogger(__name__)

Outcome = Literal["ok", "failed", "timeout", "unsupported", "skipped", "aborted"]
OUTCOMES: tuple[Outcome, ...] = ("ok", "failed", "timeout", "unsupported", "skipped", "aborted")

STDERR_LINES = 20
MAX_LINE_BYTES = 1 << 20  # a longer stdout line is not a protocol line
STDERR_LINE_BYTES = 4096  # of a longer stderr line the tail keeps the start
KILL_GRACE_SECONDS = 2.0

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

    @property
    def name(self) -> str:
        return f"{self.workload}/{self.precision}/{self.optimization} on {self.device.label}"


@dataclass(frozen=True, slots=True)
class Iteration:
    index: int
    start: float
    end: float
    work: float
    phase: str | None = None


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

    @property
    def throughput(self) -> float | None:
        """The child's own overall figure (work / duration); the analysis refines it."""
        value = None if self.result is None else self.result.get("throughput")
        return float(value) if isinstance(value, int | float) else None


def skipped(spec: ProbeSpec, reason: str) -> ProbeRun:
    now = time.time()
    return ProbeRun(uuid.uuid4().hex, spec, "skipped", reason, now, now)


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
    if device.kind == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = device.key
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


_LARGEST_INT = int(sys.float_info.max)


def _json_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity: the child writes allow_nan=False


def _json_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} does not fit a float")
    return value


def _json_int(text: str) -> int:
    value = int(text)  # a ValueError past int()'s digit limit
    if abs(value) > _LARGEST_INT:
        raise ValueError("an integer that does not fit a float")
    return value


_NUMBER = (int, float)
# What the agent reads of each line, and the JSON types it must have where present (null is
# allowed): a line that breaks this is junk, counted, never trusted. Numbers of a result are
# also non-negative.
_FIELD_TYPES: dict[str, dict[str, tuple[type, ...]]] = {
    "manifest": {
        "workload": (str,),
        "unit": (str,),
        "work_unit": (str,),
        "device_name": (str,),
        "torch": (str,),
        "python": (str,),
        "kernel": (str,),
        "threads": (int,),
        "backends": (dict,),
        "shapes": (dict,),
        "parameters": (dict,),
    },
    "result": {
        "iterations": (int,),
        "duration": _NUMBER,
        "elapsed": _NUMBER,
        "work": _NUMBER,
        "throughput": _NUMBER,
        "prefill_tokens_per_second": _NUMBER,
        "decode_tokens_per_second": _NUMBER,
        "kernel": (str,),
        "phases": (dict,),
        "latency_seconds": (dict,),
    },
    "unsupported": {"reason": (str,)},
}


def _fits(message: Mapping[str, Any], event: str) -> bool:
    for name, types in _FIELD_TYPES[event].items():
        value = message.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            return False
        if event == "result" and isinstance(value, _NUMBER) and value < 0:
            return False
    return True


class _Protocol:
    """Parses the child's stdout lines; tolerant of junk, which it counts instead of trusting.

    Junk is anything but one JSON object per line as workloads/README.md describes it: a line
    that is not JSON (binary, another encoding, truncated, too long, nested too deeply), NaN or
    Infinity anywhere (the child never writes them), a number no float can hold, an unknown
    event, a field of the wrong type, an iteration that ends before it starts or has negative
    work. ``feed`` never raises on what the child wrote.
    """

    def __init__(self, on_iteration: Callable[[Iteration], None] | None) -> None:
        self.manifest: dict[str, Any] | None = None
        self.result: dict[str, Any] | None = None
        self.unsupported: str | None = None
        self.iterations: list[Iteration] = []
        self.errors = 0
        self._on_iteration = on_iteration

    def feed(self, raw: bytes) -> None:
        message = self._parse(raw)
        event = None if message is None else message.get("event")
        if message is None or event not in ("manifest", "iteration", "result", "unsupported"):
            self.errors += 1
        elif event == "iteration":
            iteration = self._iteration(message)
            if iteration is None:
                self.errors += 1
                return
            self.iterations.append(iteration)
            if self._on_iteration is not None:
                self._on_iteration(iteration)
        elif not _fits(message, event):
            self.errors += 1
        elif event == "manifest":
            self.manifest = message
        elif event == "result":
            self.result = message
        else:
            # The reason becomes the run's: one printable line, of a bounded length.
            reason = " ".join(str(message.get("reason") or "").split())
            if not reason.isprintable():
                reason = repr(reason)[1:-1]
            self.unsupported = reason[:500] or "unsupported"

    @staticmethod
    def _parse(raw: bytes) -> dict[str, Any] | None:
        if len(raw) > MAX_LINE_BYTES:
            return None
        try:
            message = json.loads(
                raw,
                parse_constant=_json_constant,
                parse_float=_json_float,
                parse_int=_json_int,
            )
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            return None
        return message if isinstance(message, dict) else None

    @staticmethod
    def _iteration(message: Mapping[str, Any]) -> Iteration | None:
        index = message.get("index")
        phase = message.get("phase")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            return None
        if phase is not None and not isinstance(phase, str):
            return None
        values: list[float] = []
        for name in ("start", "end", "work"):
            value = message.get(name)
            if isinstance(value, bool) or not isinstance(value, _NUMBER):
                return None
            values.append(float(value))
        start, end, work = values
        if not all(math.isfinite(v) for v in values) or end < start or work < 0:
            return None
        return Iteration(index, start, end, work, phase)


def _lines(stream: IO[bytes], limit: int) -> Iterator[bytes]:
    """The lines of ``stream``; of a line longer than ``limit`` bytes only the first
    ``limit + 1`` come (newline included where it fits), the rest is read and dropped in
    pieces, so a child that writes gigabytes without a newline costs no memory."""
    while raw := stream.readline(limit + 1):
        yield raw
        while len(raw) > limit and not raw.endswith(b"\n"):
            raw = stream.readline(limit + 1)


class ProbeRunner:
    """Starts probe children and turns what they do into ``ProbeRun`` records."""

    def __init__(
        self,
        python: str | None = None,
        startup_timeout_seconds: float = 180.0,
        environment: Mapping[str, str] | None = None,
    ) -> None:
        self.python = python or sys.executable
        self.startup_timeout_seconds = startup_timeout_seconds
        self._environment = environment
        self._lock = threading.Lock()
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._stopping = False

    def child_pids(self) -> set[int]:
        """PIDs of running probe children: on a GPU they are the agent's, not foreign work."""
        with self._lock:
            return set(self._children)

    def stop(self) -> None:
        """Kill every running child's process group now; their runs end as aborted."""
        with self._lock:
            self._stopping = True
            children = list(self._children.values())
        for process in children:
            self._kill_group(process)

    def command(self, spec: ProbeSpec) -> list[str]:
        command = [
            self.python, "-m", "workloads", "run",
            "--workload", spec.workload,
            "--precision", spec.precision,
            "--optimization", spec.optimization,
            "--duration", f"{spec.duration_seconds:g}",
            "--device", spec.device.torch_device,
        ]  # fmt: skip
        if spec.size is not None:
            command += ["--size", spec.size]
        return command

    def run(
        self,
        spec: ProbeSpec,
        on_iteration: Callable[[Iteration], None] | None = None,
        command: Sequence[str] | None = None,
        run_id: str | None = None,
    ) -> ProbeRun:
        """Run ``spec`` to its end; ``command`` replaces the workload command (tests use it to
        start children that crash, raise or hang)."""
        run_id = run_id or uuid.uuid4().hex
        timeout = spec.duration_seconds + self.startup_timeout_seconds
        protocol = _Protocol(on_iteration)
        stderr_tail: deque[str] = deque(maxlen=STDERR_LINES)
        started = time.time()
        try:
            process = subprocess.Popen(
                list(command) if command is not None else self.command(spec),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=child_environment(spec.device, self._environment),
                start_new_session=True,  # its own process group, killed as a whole
            )
        except OSError as exc:
            return ProbeRun(
                run_id, spec, "failed", f"cannot start the probe: {exc}", started, time.time()
            )
        with self._lock:
            self._children[process.pid] = process
            stopping = self._stopping
        if stopping:
            self._kill_group(process)
        readers = [
            threading.Thread(target=self._read_stdout, args=(process, protocol), daemon=True),
            threading.Thread(target=self._read_stderr, args=(process, stderr_tail), daemon=True),
        ]
        for reader in readers:
            reader.start()
        timed_out = False
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
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
        else:
            outcome, reason = self._outcome(
                process.returncode, timed_out, timeout, protocol, stderr_tail
            )
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
            exit_code=None if timed_out else process.returncode,
            stderr_tail="\n".join(stderr_tail),
            protocol_errors=protocol.errors,
        )

    @staticmethod
    def _read_stdout(process: subprocess.Popen[bytes], protocol: _Protocol) -> None:
        assert process.stdout is not None
        for raw in _lines(process.stdout, MAX_LINE_BYTES):
            protocol.feed(raw)

    @staticmethod
    def _read_stderr(process: subprocess.Popen[bytes], tail: deque[str]) -> None:
        assert process.stderr is not None
        for raw in _lines(process.stderr, STDERR_LINE_BYTES):
            line = raw.decode(errors="replace").rstrip()
            if line:
                tail.append(line[:500])

    @staticmethod
    def _kill_group(process: subprocess.Popen[bytes]) -> None:
        """SIGTERM to the whole group, SIGKILL after a grace period: a hung CUDA call may not
        answer SIGTERM, and the child's own children (compile workers) must go too."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
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

    @staticmethod
    def _outcome(
        code: int | None,
        timed_out: bool,
        timeout: float,
        protocol: _Protocol,
        stderr_tail: deque[str],
    ) -> tuple[Outcome, str]:
        if timed_out:
            return "timeout", (
                f"no result within {timeout:g} s; process group killed "
                f"after {len(protocol.iterations)} iterations"
            )
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
