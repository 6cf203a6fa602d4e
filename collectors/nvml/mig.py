"""MIG devices and a GPU's place on the host: what the collector needs to see and probe them.

A GPU in MIG mode runs nothing by its own UUID: work runs on its MIG devices (compute instances,
``MIG-...`` UUIDs, at most ``nvmlDeviceGetMaxMigDeviceCount`` of them), which CUDA takes by UUID in
``CUDA_VISIBLE_DEVICES``. Utilization reads N/A on such a GPU, so whether it is busy is told by
the processes on its instances. NVML calls, in the order the NVML API reference documents them:
``nvmlDeviceGetMigMode`` (current, pending), ``nvmlDeviceGetMaxMigDeviceCount``,
``nvmlDeviceGetMigDeviceHandleByIndex`` (NVML_ERROR_NOT_FOUND for an empty slot),
``nvmlDeviceGetUUID``, ``nvmlDeviceGetGpuInstanceId``, ``nvmlDeviceGetComputeInstanceId`` on the
MIG handle.

The CPUs nearest a GPU come from ``nvmlDeviceGetCpuAffinityWithinScope`` (scope NUMA node;
``nvmlDeviceGetCpuAffinity`` on drivers without it), an array of 64-bit masks, CPU i =
bit i % 64 of element i // 64, and its NUMA node from ``nvmlDeviceGetNumaNodeId``; the probe
children of that GPU are bound to those CPUs, so that pinned host buffers are allocated on the
GPU's socket.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pynvml

from collectors.base import Labels, Reading
from collectors.nvml.gpm import Gpm
from collectors.nvml.library import Absent, CallFailed, NvmlLibrary, binding
from collectors.nvml.library import text as nvml_text

log = logging.getLogger(__name__)

# How often a MIG GPU's instances are listed again: an operator may create or destroy them while
# the agent runs (mode changes need a GPU reset, instances do not).
MIG_SCAN_SECONDS = 60.0


@dataclass
class MigDevice:
    """One MIG device (a compute instance) of a MIG-enabled GPU, and its last readings."""

    uuid: str
    handle: Any
    gpu_instance: int
    compute_instance: int
    labels: Labels
    gpm: Gpm = field(default_factory=Gpm)
    readings: tuple[Reading, ...] = ()
    foreign_pids: tuple[int, ...] = ()  # of its last process list, the agent's own left out


def scan(
    library: NvmlLibrary, handle: Any, index: int, parent_uuid: str, known: Iterable[MigDevice]
) -> list[MigDevice]:
    """The MIG devices of the GPU ``handle`` (in MIG mode), in slot order; one already known by
    its UUID keeps its state (its GPM stream). A slot that cannot be read is left out, logged.
    ``DeviceLost`` propagates: the GPU is gone, not one slot."""
    kept = {mig.uuid: mig for mig in known}
    try:
        slots = int(library.call(pynvml.nvmlDeviceGetMaxMigDeviceCount, handle))
    except (Absent, CallFailed) as exc:
        log.warning("GPU %d: MIG mode on, but its MIG devices cannot be counted (%s)", index, exc)
        return []
    found = []
    for slot in range(slots):
        try:
            mig = library.call(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot)
        except Absent:  # NVML_ERROR_NOT_FOUND: no instance in this slot
            continue
        except CallFailed as exc:
            log.warning("GPU %d: MIG slot %d unreadable (%s)", index, slot, exc)
            continue
        try:
            uuid = nvml_text(library.call(pynvml.nvmlDeviceGetUUID, mig))
            gpu_instance = int(library.call(pynvml.nvmlDeviceGetGpuInstanceId, mig))
            compute_instance = int(library.call(pynvml.nvmlDeviceGetComputeInstanceId, mig))
        except (Absent, CallFailed) as exc:
            log.warning("GPU %d: MIG slot %d cannot be identified (%s)", index, slot, exc)
            continue
        device = kept.get(uuid)
        if device is None:
            labels = (
                ("device", str(index)),
                ("uuid", uuid),
                ("parent", parent_uuid),
                ("mig_instance", str(gpu_instance)),
            )
            device = MigDevice(uuid, mig, gpu_instance, compute_instance, labels)
        device.handle = mig
        found.append(device)
    if [m.uuid for m in found] != [m.uuid for m in kept.values()]:
        log.info(
            "GPU %d (%s): MIG mode, %d MIG device(s): %s",
            index,
            parent_uuid,
            len(found),
            ", ".join(f"{m.uuid} (GPU instance {m.gpu_instance})" for m in found) or "none",
        )
    return found


def cpu_list(cpus: Iterable[int]) -> str:
    """CPUs in the kernel's cpulist syntax: {0, 1, 2, 3, 8} -> "0-3,8"."""
    ranges: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def parse_cpu_list(text: str) -> frozenset[int]:
    """The kernel's cpulist syntax read back: "0-3,8" -> {0, 1, 2, 3, 8}; ValueError if bad."""
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        low, high = int(first), int(last or first)
        if low < 0 or high < low:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def topology(library: NvmlLibrary, handle: Any) -> Labels:
    """``(("cpu_affinity", "0-23,48-71"), ("numa_node", "0"))`` of the GPU, or () when the
    driver cannot say (an older driver, a VM without the topology)."""
    words = max(1, ((os.cpu_count() or 1) + 63) // 64)
    try:
        masks = library.call_first(
            (
                pynvml.nvmlDeviceGetCpuAffinityWithinScope,
                (handle, words, pynvml.NVML_AFFINITY_SCOPE_NODE),
            ),
            (pynvml.nvmlDeviceGetCpuAffinity, (handle, words)),
        )
    except (Absent, CallFailed):
        return ()
    cpus = [
        64 * position + bit
        for position, mask in enumerate(masks)
        for bit in range(64)
        if int(mask) >> bit & 1
    ]
    if not cpus:
        return ()
    try:
        node = str(int(library.call(binding("nvmlDeviceGetNumaNodeId"), handle)))
    except (Absent, CallFailed):
        node = ""
    return (("cpu_affinity", cpu_list(cpus)), ("numa_node", node))
