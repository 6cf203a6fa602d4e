"""Yielding to production: what a running probe watches for, and stops for (probing.preempt).

The busy checks keep a probe from starting on a device that production uses; these watches stop
one that is running when production arrives. The runner asks its watch every 0.1 s; a watch
answers None, or the ``Intruder`` (pid, process name, where, when), and the runner then kills
the child's process group at once and records the run as ``preempted``:

- A GPU probe yields to a compute process that is not the agent's own appearing on its GPU, or
  on any MIG device of its GPU (the instances share the GPU's power and clocks). The NVML
  collector's samples name them (``Sample.foreign_pids``, the process lists re-read every 0.5 s
  while the sampler runs at the fast interval), so a process is seen within about 0.6 s of its
  start. Processes already there when the probe started are not arrivals: the busy check let
  the probe start beside them (``skip_foreign_processes = false``).
- A CPU probe yields to a foreign process (outside the agent's own process tree, which holds the
  probe child and its workers) that used more than ``preempt_cpu_share`` of all CPUs over the
  last 0.5 s window, measured by a process-table meter of its own (collectors/processes.py): a
  read of the table twice a second while a CPU probe runs, none otherwise.

A process's name comes from psutil where its pid is visible; NVML's pids may belong to another
pid namespace (a container that does not share the host's), and the name is then "unknown".
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import psutil

from agent.probes.runner import Intruder, ProbeDevice
from agent.telemetry.store import TelemetryStore
from collectors.base import Sample
from collectors.processes import ProcessCpuMeter

CPU_WINDOW_SECONDS = 0.5
UNKNOWN = "unknown"


def process_name(pid: int) -> str:
    """The name of process ``pid`` as this agent sees it, or "unknown"."""
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return UNKNOWN


class GpuWatch:
    """Compute processes arriving on the GPUs of ``devices`` (a GPU, or a MIG device's GPU)."""

    def __init__(self, store: TelemetryStore, devices: Sequence[ProbeDevice]) -> None:
        self._store = store
        self._gpus = {device.gpu: device.label for device in devices}
        self._present = set(self._foreign())

    def __call__(self) -> Intruder | None:
        for pid, (where, seen_at) in sorted(self._foreign().items()):
            if pid not in self._present:
                return Intruder(pid, process_name(pid), where, seen_at)
        return None

    def _foreign(self) -> dict[int, tuple[str, float]]:
        """Every foreign pid on the watched GPUs: where it is ("appeared on GPU 1", on a MIG
        device "appeared on GPU 0 MIG 2") and the time of the sample that listed it."""
        found: dict[int, tuple[str, float]] = {}
        whole: list[Sample] = []
        for sample in self._store.latest():
            if sample.collector != "nvml" or not sample.foreign_pids:
                continue
            if sample.device in self._gpus:
                whole.append(sample)
                continue
            mig = next((dict(r.labels) for r in sample.readings if r.field == "gpu_mig_info"), {})
            label = self._gpus.get(mig.get("parent", ""))
            if label is not None:
                where = f"appeared on GPU {label} MIG {mig.get('mig_instance', '?')}"
                for pid in sample.foreign_pids:
                    found.setdefault(pid, (where, sample.timestamp))
        # A MIG GPU's own list holds its instances' processes too: named by instance above.
        for sample in whole:
            for pid in sample.foreign_pids:
                found.setdefault(
                    pid, (f"appeared on GPU {self._gpus[sample.device]}", sample.timestamp)
                )
        return found


class CpuWatch:
    """A foreign process taking more than ``share`` of all CPUs, over windows of 0.5 s."""

    def __init__(self, meter: ProcessCpuMeter, share: float, cpus: int | None = None) -> None:
        self._meter = meter
        self._share = share
        self._cpus = cpus or os.cpu_count() or 1
        self._meter.poll()  # what the first window is measured from
        self._due = time.monotonic() + CPU_WINDOW_SECONDS

    def __call__(self) -> Intruder | None:
        now = time.monotonic()
        if now < self._due:
            return None
        self._due = now + CPU_WINDOW_SECONDS
        use = self._meter.poll()
        if use is None or not use.processes:
            return None
        busiest = use.processes[0]
        if busiest.cpus <= self._share * self._cpus:
            return None
        return Intruder(
            busiest.pid,
            busiest.name or UNKNOWN,
            f"used {busiest.cpus:.2f} of {self._cpus} CPUs (more than {self._share:g} of them)",
            time.time(),
        )
