"""Who runs on each device: the pods the kubelet allocated it to, else the Slurm jobs of the
processes NVML lists on it.

The tracker is a sampler sink: from the NVML samples it learns each device's label (GPU index)
and UUID, the parent of a MIG device, and the foreign processes on it. It names occupants on
demand, for the exposition (``status``) and for the events the archive stores (``enrich``)::

    sustain_device_pod_info{container="main",device="1",namespace="ml",pod="train-0",
                            uuid="GPU-2b9e..."} 1.0

A GPU shared by time-slicing may be allocated to thousands of containers: each is kept once
(a dict, not a list searched per container), the names are cut to ``MAX_LABEL_CHARS``, and the
exposition names ``MAX_PODS_PER_DEVICE`` of them per device, counting the rest.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from agent.config.archive_section import OccupancySection
from agent.occupancy.podresources import Allocation, PodResourcesWatch
from agent.occupancy.slurm import SlurmJobs
from collectors.base import Event, Sample

log = logging.getLogger(__name__)

MAX_LABEL_CHARS = 128  # Kubernetes allows a pod name of 253
CUT_MARKER = "..."
MAX_PODS_PER_DEVICE = 100  # sustain_device_pod_info series per device; the rest are counted


def capped(value: str) -> str:
    """``value``, or its start and its end around ``CUT_MARKER``, ``MAX_LABEL_CHARS`` in all: the
    end is kept because that is where the names of one workload's pods differ (``train-7f9c-0``)."""
    if len(value) <= MAX_LABEL_CHARS:
        return value
    head = (MAX_LABEL_CHARS - len(CUT_MARKER)) // 2
    tail = MAX_LABEL_CHARS - len(CUT_MARKER) - head
    return value[:head] + CUT_MARKER + value[-tail:]


@dataclass(frozen=True, slots=True)
class Occupant:
    """A Kubernetes container (namespace, pod, container) or a Slurm job."""

    namespace: str = ""
    pod: str = ""
    container: str = ""
    slurm_job: str = ""

    def describe(self) -> str:
        if self.pod:
            return f"pod {self.namespace}/{self.pod} container {self.container}"
        return f"slurm job {self.slurm_job}"

    def attributes(self) -> tuple[tuple[str, str], ...]:
        if self.pod:
            return (("pod", f"{self.namespace}/{self.pod}"), ("container", self.container))
        return (("slurm_job", self.slurm_job),)


@dataclass(frozen=True, slots=True)
class OccupancyStatus:
    """For the exposition: who holds what, and how the kubelet's answers went."""

    pods: list[tuple[str, str, str, str, str]]  # (device, uuid, namespace, pod, container)
    requests: dict[str, int]  # outcome -> count
    last_success: float | None  # Unix time of the kubelet's last answer
    # (device, uuid) -> containers beyond MAX_PODS_PER_DEVICE, not in ``pods``
    omitted: dict[tuple[str, str], int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Device:
    label: str  # the GPU index ("device" label); a MIG device's is its parent's
    uuid: str
    parent: str | None  # the parent GPU's UUID of a MIG device


class Occupancy:
    """Tracks the devices the samplers see and names who occupies each one."""

    def __init__(self, settings: OccupancySection, procfs: Path) -> None:
        self.settings = settings
        self.watch = PodResourcesWatch(
            settings.pod_resources_socket,
            settings.pod_resources_interval_seconds,
            settings.pod_resources_timeout_seconds,
        )
        self.slurm = SlurmJobs(procfs) if settings.slurm else None
        self._lock = threading.Lock()
        self._devices: dict[str, _Device] = {}  # by UUID
        self._not_devices: set[tuple[str, str]] = set()  # (collector, device) without a UUID
        self._pids: dict[str, tuple[int, ...]] = {}  # foreign pids by device UUID

    def start(self) -> None:
        self.watch.start()

    def stop(self) -> None:
        self.watch.stop()

    def record(self, sample: Sample) -> None:
        """Sampler sink: learn the sample's device once, then only its foreign processes."""
        device = self._devices.get(sample.device)
        if device is None:
            if (sample.collector, sample.device) in self._not_devices:
                return
            device = _identify(sample)
            with self._lock:
                if device is None:
                    if sample.readings:
                        self._not_devices.add((sample.collector, sample.device))
                    return
                self._devices[device.uuid] = device
        if self._pids.get(device.uuid) != sample.foreign_pids:
            with self._lock:
                self._pids[device.uuid] = sample.foreign_pids

    def _resolve(self, allocation: Allocation, devices: dict[str, _Device]) -> _Device | None:
        # Shared GPUs (time-slicing) are allocated as replicas: "GPU-...::3".
        device_id = allocation.device_id.partition("::")[0]
        found = devices.get(device_id)
        if found is None and device_id.isdigit():
            found = next(
                (d for d in devices.values() if d.parent is None and d.label == device_id), None
            )
        return found

    def _pods(self) -> dict[str, dict[Occupant, None]]:
        """Occupants of each device the kubelet allocated (by UUID), in the kubelet's order."""
        with self._lock:
            devices = dict(self._devices)
        held: dict[str, dict[Occupant, None]] = {}
        for allocation in self.watch.allocations():
            device = self._resolve(allocation, devices)
            if device is None:
                continue
            occupant = Occupant(
                capped(allocation.namespace), capped(allocation.pod), capped(allocation.container)
            )
            held.setdefault(device.uuid, {})[occupant] = None
        return held

    def occupants(self, uuid: str) -> tuple[Occupant, ...]:
        """The pods holding the device (or one of its MIG devices), else the Slurm jobs of the
        foreign processes on it; empty when nobody is known."""
        held = self._pods()
        with self._lock:
            members = [uuid, *(d.uuid for d in self._devices.values() if d.parent == uuid)]
            pids = {member: self._pids.get(member, ()) for member in members}
            everyone = {pid for seen in self._pids.values() for pid in seen}
        pods = [occupant for member in members for occupant in held.get(member, ())]
        if pods:
            return tuple(dict.fromkeys(pods))
        if self.slurm is None:
            return ()
        jobs: dict[Occupant, None] = {}
        for pid in (pid for member in members for pid in pids[member]):
            job = self.slurm.job_of(pid)
            if job is not None:
                jobs[Occupant(slurm_job=job)] = None
        self.slurm.keep_only(everyone)
        return tuple(jobs)

    def enrich(self, sample: Sample) -> Sample:
        """The sample with the occupants of each event's device added to its attributes (several
        occupants: their values joined by commas); the same sample when nothing is added."""
        if not sample.events:
            return sample
        events = tuple(self._enrich_event(event) for event in sample.events)
        if all(new is old for new, old in zip(events, sample.events, strict=True)):
            return sample
        return dataclasses.replace(sample, events=events)

    def _enrich_event(self, event: Event) -> Event:
        occupants = self.occupants(event.device)
        if not occupants:
            return event
        merged: dict[str, list[str]] = {}
        for occupant in occupants:
            for key, value in occupant.attributes():
                merged.setdefault(key, []).append(value)
        added = tuple((key, ",".join(values)) for key, values in merged.items())
        return dataclasses.replace(event, attributes=(*event.attributes, *added))

    def status(self) -> OccupancyStatus:
        held = self._pods()
        with self._lock:
            devices = dict(self._devices)
        pods: list[tuple[str, str, str, str, str]] = []
        omitted: dict[tuple[str, str], int] = {}
        for uuid, occupants in held.items():
            label = devices[uuid].label
            named = sorted((o.namespace, o.pod, o.container) for o in occupants)
            pods += [(label, uuid, *names) for names in named[:MAX_PODS_PER_DEVICE]]
            if len(named) > MAX_PODS_PER_DEVICE:
                omitted[label, uuid] = len(named) - MAX_PODS_PER_DEVICE
        return OccupancyStatus(
            sorted(pods), self.watch.requests(), self.watch.last_success, omitted
        )


def _identify(sample: Sample) -> _Device | None:
    """The device a sample's readings name: labels ("device", X) and ("uuid", sample.device)."""
    for reading in sample.readings:
        labels = dict(reading.labels)
        if labels.get("uuid") == sample.device and "device" in labels:
            return _Device(labels["device"], sample.device, labels.get("parent"))
    return None
