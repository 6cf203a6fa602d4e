"""The devices a probe plan runs on, and the telemetry a running probe keeps.

``gpu_devices`` reads them from the NVML collector's latest samples (whole GPUs, and a MIG GPU's
MIG devices in its place); ``node_device`` is the node as one device (allreduce); ``plan_specs``
turns a plan entry into runs, for the daemon and `sustain probe` alike; ``plan_precisions`` leaves
out what a device runs only without native support (the built-in
plan); ``TelemetryCapture`` keeps, per running probe, the samples of its devices.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from agent.config import names
from agent.config.names import NODE_WIDE
from agent.config.settings import ProbePlanEntry, ProbingSection
from agent.probes.runner import CPU, ProbeDevice, ProbeRunner, ProbeSpec
from agent.telemetry.store import TelemetryStore
from collectors.base import Sample
from collectors.nvml.mig import cpu_list, parse_cpu_list

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
    """The healthy GPUs the NVML collector reports, in index order. A GPU in MIG mode runs
    nothing by its own UUID: its MIG devices are listed instead (by their MIG-... UUIDs), each
    with the GPU's nearest CPUs."""
    # uuid -> labels, cpus, MIG mode, compute capability
    gpus: dict[str, tuple[dict[str, str], str, bool, tuple[int, int] | None]] = {}
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
        info = readings.get("gpu_info")
        gpus[sample.device] = (
            dict(healthy.labels),
            "" if topology is None else dict(topology.labels).get("cpu_affinity", ""),
            mode is not None and mode.value == 1.0,
            None if info is None else capability(dict(info.labels).get("compute_capability")),
        )
    found = [
        ProbeDevice(
            "cuda", uuid, labels["device"], int(labels["device"]), cpus=cpus, capability=version
        )
        for uuid, (labels, cpus, mig_mode, version) in gpus.items()
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
                    capability=parent[3],
                )
            )
    return sorted(found, key=lambda device: (device.index or 0, int(device.mig or 0)))


def capability(text: str | None) -> tuple[int, int] | None:
    """ "9.0" (the ``compute_capability`` label of gpu_info) as (9, 0); None where absent."""
    major, _, minor = (text or "").partition(".")
    if not (major.isdigit() and minor.isdigit()):
        return None
    return int(major), int(minor)


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


def plan_specs(
    probing: ProbingSection,
    entry: ProbePlanEntry,
    devices: Sequence[ProbeDevice],
    runner: ProbeRunner,
    *,
    precisions: Sequence[str] = (),
    optimizations: Sequence[str] = (),
    duration: float | None = None,
    size: str | None = None,
) -> list[ProbeSpec]:
    """The runs of one plan entry on ``devices``, as the daemon and `sustain probe` both start
    them: a node-wide workload (allreduce) once, on the node as one device with every GPU
    visible to it (``node_device``); any other on each device in turn. ``precisions``,
    ``optimizations``, ``duration`` and ``size`` override the entry's (`sustain probe` flags); a
    variant the workload does not declare is left out (`--precision bf16` with membw)."""
    node_wide = entry.workload in NODE_WIDE
    targets = [node_device(devices)] if node_wide else list(devices)
    if size is None and entry.size != "default":
        size = entry.size
    return [
        ProbeSpec(
            entry.workload,
            precision,
            optimization,
            duration or entry.duration_seconds,
            device,
            size,
            scope="node" if node_wide else "device",
        )
        for device in targets
        for precision in (list(precisions) or plan_precisions(probing, entry, runner, device))
        for optimization in (list(optimizations) or entry.optimizations)
        if names.declares(entry.workload, precision, optimization)
    ]


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
