"""NVIDIA GPUs through NVML (nvidia-ml-py, module ``pynvml``): one sample per GPU per poll.

Every call goes through ``NvmlLibrary``, so a field the device lacks is absent from the sample —
never 0, never a sentinel — a lost GPU is marked unhealthy and looked for again, and a transient
failure costs that field for that sample and is counted. Units are converted here and nowhere
else (MHz -> hertz, mW -> watts, mJ -> joules, percent -> ratio, ns -> seconds, NVML's KB/s,
1000 bytes a second, -> bytes/s). The exposition::

    sustain_gpu_clock_hertz{clock="sm",device="0",uuid="GPU-7d3a..."} 1.41e+09
    sustain_gpu_power_watts{device="0",uuid="GPU-7d3a..."} 352.4
    sustain_gpu_clock_event_reason_active{device="1",reason="hw_thermal_slowdown",uuid=...} 1.0
    sustain_gpu_clock_event_reason_seconds_total{device="1",reason="hw_thermal_slowdown",...} 30.0
    sustain_gpu_healthy{device="0",uuid="GPU-7d3a..."} 1.0
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pynvml

from collectors.base import CollectorError, Event, Field, Labels, Reading, Sample
from collectors.nvml.fields import (
    CLOCKS,
    ECC,
    FIELD_IDS,
    FIELDS,
    POLICIES,
    POWER_AVERAGE,
    POWER_INSTANT,
    REASONS,
    THROTTLE_REASONS,
)
from collectors.nvml.gpm import Gpm, GpmReader
from collectors.nvml.library import (
    Absent,
    CallFailed,
    DeviceLost,
    FunctionMissing,
    NvmlLibrary,
    binding,
    binding_version,
    cuda_version_text,
    transient_kind,
)
from collectors.nvml.library import text as nvml_text
from collectors.nvml.mig import MIG_SCAN_SECONDS, MigDevice, scan, topology
from collectors.nvml.xid import XidWatcher, handle_key

log = logging.getLogger(__name__)

# How often a lost device is looked for again, and how long slow readings are repeated.
RETRY_SECONDS = 5.0
FULL_READ_SECONDS = 0.5


# nvmlValue_t's member for each value type the installed nvidia-ml-py knows: UNSIGNED_SHORT came
# in 12.560 and its ``usVal`` member in 12.570, so an older binding leaves such a field absent.
_VALUE_MEMBERS = {
    getattr(pynvml, constant): member
    for constant, member in (
        ("NVML_VALUE_TYPE_DOUBLE", "dVal"),
        ("NVML_VALUE_TYPE_UNSIGNED_INT", "uiVal"),
        ("NVML_VALUE_TYPE_UNSIGNED_LONG", "ulVal"),
        ("NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", "ullVal"),
        ("NVML_VALUE_TYPE_SIGNED_LONG_LONG", "sllVal"),
        ("NVML_VALUE_TYPE_SIGNED_INT", "siVal"),
        ("NVML_VALUE_TYPE_UNSIGNED_SHORT", "usVal"),
    )
    if hasattr(pynvml, constant)
}
_UNREADABLE_TYPES: set[int] = set()  # logged once each

# NVML_PSTATE_0 (fastest) to NVML_PSTATE_15; NVML_PSTATE_UNKNOWN (32) is no state: absent.
_PSTATES = range(16)

# nvmlDeviceGetPcieThroughput answers KB/s: nvml.h ("Reference in which to return throughput in
# KB/s"), which writes KiB where it means 1024 bytes (the NVLink throughput fields 138-141, the
# GPM PCIe metrics' MiB/sec); dcgm-exporter exports the same value as "KB/s" unchanged.
_PCIE_BYTES_PER_KB = 1000
# Each call samples a byte counter for 20 ms and blocks that long (NVML reference), two per GPU:
# 40 ms per GPU, 320 ms for 8. Each GPU is read at most every PCIE_THROUGHPUT_SECONDS, the GPUs'
# turns spread over that period, its last values repeated in between: at 10 Hz a poll waits for
# about one GPU's 40 ms instead of all eight at once at every slow read.
PCIE_THROUGHPUT_SECONDS = 1.0


def _field_number(value: Any) -> float | None:
    """The number in an nvmlFieldValue_t, or None when NVML returned an error for it or the
    installed nvidia-ml-py cannot read its value type."""
    if value.nvmlReturn != pynvml.NVML_SUCCESS:
        return None
    member = _VALUE_MEMBERS.get(value.valueType)
    if member is None or not hasattr(value.value, member):
        if value.valueType not in _UNREADABLE_TYPES:
            _UNREADABLE_TYPES.add(value.valueType)
            log.info(
                "nvidia-ml-py %s cannot read NVML value type %d: such fields are absent",
                binding_version(),
                value.valueType,
            )
        return None
    return float(getattr(value.value, member))


@dataclass
class _Device:
    """What the collector remembers of one GPU between polls."""

    index: int
    uuid: str
    handle: Any
    identity: Labels
    labels: Labels
    healthy: bool = True
    retry_at: float = 0.0
    last_poll: float | None = None
    last_reasons: int | None = None
    reason_seconds: dict[str, float] = field(default_factory=dict)
    episode_start: dict[str, float] = field(default_factory=dict)  # throttle reason -> since
    gpm: Gpm = field(default_factory=Gpm)
    topology: Labels = ()
    migs: list[MigDevice] = field(default_factory=list)
    mig_scanned: float | None = None
    last_full: float | None = None
    slow_readings: tuple[Reading, ...] = ()
    foreign_pids: tuple[int, ...] = ()  # read with the slow fields, repeated with them
    xid_counts: Counter[int] = field(default_factory=Counter)
    xid_last_seen: dict[int, float] = field(default_factory=dict)
    unknown_fields: set[int] = field(default_factory=set)  # answered INVALID_ARGUMENT: not asked
    gpm_capable: bool | None = None  # nvmlGpmQueryDeviceSupport's answer, asked once
    pcie_due: float | None = None  # when the PCIe throughput is read next; None: at once
    pcie_readings: tuple[Reading, ...] = ()


class _Poll:
    """Readings and error kinds of one device during one poll."""

    __slots__ = ("device", "errors", "foreign_pids", "handle", "labels", "library", "readings")

    def __init__(self, library: NvmlLibrary, device: _Device, mig: MigDevice | None = None) -> None:
        """A poll of ``device``, or of its MIG device ``mig`` (its handle and labels)."""
        self.library = library
        self.device = device
        self.handle = device.handle if mig is None else mig.handle
        self.labels = device.labels if mig is None else mig.labels
        self.readings: list[Reading] = []
        self.errors: list[str] = []
        self.foreign_pids: tuple[int, ...] = ()

    def add(self, key: str, value: float | None, *labels: tuple[str, str]) -> None:
        if value is not None:
            self.readings.append(Reading(key, float(value), (*self.labels, *labels)))

    def get(self, function: Callable[..., Any], *args: Any) -> Any:
        """The call's result, or None when the field is absent or the call failed this time."""
        try:
            return self.library.call(function, self.handle, *args)
        except Absent:
            return None
        except CallFailed as exc:
            self.errors.append(exc.kind)
            return None

    def first(self, *calls: tuple[Callable[..., Any], tuple[Any, ...]]) -> Any:
        handle = self.handle
        try:
            return self.library.call_first(*((fn, (handle, *args)) for fn, args in calls))
        except Absent:
            return None
        except CallFailed as exc:
            self.errors.append(exc.kind)
            return None


class NvmlCollector:
    """All GPUs NVML sees; one sample per GPU per poll, plus one for the driver versions."""

    name = "nvml"

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        own_pids: Callable[[], set[int]] = set,
        library: NvmlLibrary | None = None,
    ) -> None:
        """``clock`` gives sample timestamps and the time the reason counters integrate; tests
        pass the fake driver's scaled clock so that hours of scenario run in minutes.
        ``own_pids`` are the agent's probe children: not foreign work on a GPU. ``library`` is
        the NVML session (tests pass one whose retries run on their own clock)."""
        self._clock = clock
        self._own_pids = own_pids
        self._library = library or NvmlLibrary()
        self._devices: list[_Device] = []
        self._system: tuple[Reading, ...] = ()
        self._lock = threading.Lock()  # devices' XID state is written by the watcher thread
        self._xid = XidWatcher(self._library, self._record_xid)
        self._gpm = GpmReader(self._library)
        self._pending_events: list[Event] = []
        self._own: set[int] | None = None
        self._unidentified: dict[int, tuple[str, float]] = {}  # index -> (error kind, retry at)

    @property
    def library(self) -> NvmlLibrary:
        """The collector's NVML session, shared with the stack snapshots (one init per process)."""
        return self._library

    @property
    def fields(self) -> Mapping[str, Field]:
        return FIELDS

    def _discover(self) -> None:
        library = self._library
        versions = []
        for function, show in (
            (pynvml.nvmlSystemGetDriverVersion, nvml_text),
            (pynvml.nvmlSystemGetNVMLVersion, nvml_text),
            (pynvml.nvmlSystemGetCudaDriverVersion, lambda value: cuda_version_text(int(value))),
        ):
            try:
                versions.append(show(library.call(function)))
            except (Absent, CallFailed):
                versions.append("")
        labels = tuple(
            zip(("driver_version", "nvml_version", "cuda_driver_version"), versions, strict=True)
        )
        self._system = (Reading("nvml_info", 1.0, labels),)
        try:
            count = int(library.call(pynvml.nvmlDeviceGetCount))
        except (Absent, CallFailed) as exc:
            raise CollectorError(f"cannot count GPUs: {exc}") from None
        for index in range(count):
            self._try_identify(index, self._clock())
        log.info(
            "NVML: driver %s, %d GPU(s): %s",
            versions[0] or "unknown",
            len(self._devices),
            ", ".join(dict(d.identity)["name"] for d in self._devices) or "none",
        )
        self._xid.start([device.handle for device in self._devices])

    def _try_identify(self, index: int, now: float) -> bool:
        """Identify GPU ``index``; one NVML cannot identify (lost at start, not answering) is
        asked again every RETRY_SECONDS, and meanwhile sampled as ``gpu_healthy`` 0 with no
        UUID (the health monitor's ``device_lost`` or ``unidentified``)."""
        library = self._library
        try:
            handle = library.call(pynvml.nvmlDeviceGetHandleByIndex, index)
            uuid = nvml_text(library.call(pynvml.nvmlDeviceGetUUID, handle))
        except (Absent, CallFailed, DeviceLost) as exc:
            kind = "device_lost" if isinstance(exc, DeviceLost) else "device_unidentified"
            if index not in self._unidentified:
                log.warning("GPU %d: cannot identify it (%s); asked again every %.0f s", index,
                            exc or kind, RETRY_SECONDS)  # fmt: skip
            self._unidentified[index] = (kind, now + RETRY_SECONDS)
            return False
        if index in self._unidentified:
            log.warning("GPU %d (%s) identified: it answers again", index, uuid)
        self._unidentified.pop(index, None)
        if all(device.uuid != uuid for device in self._devices):
            self._devices.append(self._identify(index, uuid, handle))
        return True

    def _unidentified_samples(self, now: float) -> list[Sample]:
        samples = []
        for index, (kind, retry_at) in sorted(self._unidentified.items()):
            if now >= retry_at and self._try_identify(index, now):
                for device in self._devices:
                    if device.index == index:
                        self._xid.register(device.handle)
                continue
            labels = (("device", str(index)), ("uuid", ""))
            readings = (Reading("gpu_healthy", 0.0, labels),)
            samples.append(Sample(self.name, f"gpu-index-{index}", now, readings, (kind,)))
        return samples

    def _identify(self, index: int, uuid: str, handle: Any) -> _Device:
        def text(function: Callable[..., Any]) -> str:
            try:
                return nvml_text(self._library.call(function, handle))
            except (Absent, CallFailed, DeviceLost):
                return ""

        try:
            pci = self._library.call(pynvml.nvmlDeviceGetPciInfo_v3, handle)
            bus_id = nvml_text(pci.busId)
        except (Absent, CallFailed, DeviceLost):
            bus_id = ""
        try:
            major, minor = self._library.call(pynvml.nvmlDeviceGetCudaComputeCapability, handle)
            capability = f"{int(major)}.{int(minor)}"
        except (Absent, CallFailed, DeviceLost):
            capability = ""
        labels = (("device", str(index)), ("uuid", uuid))
        identity = (
            *labels,
            ("name", text(pynvml.nvmlDeviceGetName)),
            ("pci_bus_id", bus_id),
            ("serial", text(pynvml.nvmlDeviceGetSerial)),
            # What the probe plan reads for the precisions a GPU runs natively, without a CUDA
            # context on a GPU that may be a production job's (agent.probes.devices).
            ("compute_capability", capability),
        )
        return _Device(
            index=index,
            uuid=uuid,
            handle=handle,
            identity=identity,
            labels=labels,
            topology=topology(self._library, handle),
        )

    def _record_xid(self, key: int | None, xid: int) -> None:
        timestamp = self._clock()
        with self._lock:
            for device in self._devices:
                if handle_key(device.handle) == key:
                    device.xid_counts[xid] += 1
                    device.xid_last_seen[xid] = timestamp
                    self._pending_events.append(
                        Event(
                            "xid",
                            device.uuid,
                            timestamp,
                            f"GPU {device.index}: XID {xid}",
                            (("xid", str(xid)),),
                        )
                    )
                    return

    def collect(self) -> Sequence[Sample]:
        if self._library.start():
            self._discover()
        now = self._clock()
        self._own = None  # the agent's pids, read once per poll when a process list is
        samples = [Sample(self.name, "system", now, self._system)]
        samples += self._unidentified_samples(now)
        for device in self._devices:
            samples.append(self._poll_device(device, now))
            if device.healthy:
                samples.extend(
                    Sample(self.name, mig.uuid, now, mig.readings, foreign_pids=mig.foreign_pids)
                    for mig in device.migs
                )
        with self._lock:
            events, self._pending_events = self._pending_events, []
        if events:
            first = samples[0]
            samples[0] = Sample(
                first.collector, first.device, first.timestamp, first.readings, events=tuple(events)
            )
        return samples

    def _poll_device(self, device: _Device, now: float) -> Sample:
        events: list[Event] = []
        if not device.healthy:
            if now < device.retry_at or not self._reacquire(device, now):
                return Sample(
                    self.name, device.uuid, now, (Reading("gpu_healthy", 0.0, device.labels),)
                )
            events.append(
                Event(
                    "device_recovered",
                    device.uuid,
                    now,
                    f"GPU {device.index} ({device.uuid}) answers again",
                )
            )
        poll = _Poll(self._library, device)
        try:
            self._read(poll, now)
        except DeviceLost as exc:
            device.healthy = False
            device.retry_at = now + RETRY_SECONDS
            device.last_full = None
            device.slow_readings = ()
            device.pcie_due, device.pcie_readings = None, ()
            device.last_poll = None
            device.last_reasons = None
            for stream in (device.gpm, *(mig.gpm for mig in device.migs)):
                self._gpm.drop(stream)
            device.migs = []
            log.error("GPU %d (%s) lost: %s", device.index, device.uuid, exc)
            events.append(
                Event(
                    "device_lost",
                    device.uuid,
                    now,
                    f"GPU {device.index} ({device.uuid}) lost: {exc}",
                )
            )
            return Sample(
                self.name,
                device.uuid,
                now,
                (Reading("gpu_healthy", 0.0, device.labels),),
                errors=("device_lost",),
                events=tuple(events),
            )
        device.healthy = True
        return Sample(
            self.name,
            device.uuid,
            now,
            tuple(poll.readings),
            tuple(poll.errors),
            tuple(events),
            poll.foreign_pids,
        )

    def _reacquire(self, device: _Device, now: float) -> bool:
        """Look for a lost GPU by its UUID (its index may change when it comes back)."""
        try:
            handle = self._library.call(pynvml.nvmlDeviceGetHandleByUUID, device.uuid)
            self._library.call(pynvml.nvmlDeviceGetUUID, handle)
        except (Absent, CallFailed, DeviceLost):
            device.retry_at = now + RETRY_SECONDS
            return False
        with self._lock:
            device.handle = handle
        device.gpm = Gpm()  # a refused GPM is asked again once the GPU is back
        device.gpm_capable = None
        device.mig_scanned = None
        self._xid.register(handle)
        return True

    def _read(self, poll: _Poll, now: float) -> None:
        """The fast fields (clocks, power, energy, temperatures, utilization, reasons, the field
        values) on every poll; the slow ones (identity, limits, memory, PCIe link, fan, P-state,
        row remapping, GPM, processes) at most every FULL_READ_SECONDS, their last values
        repeated in between, so that sampling at 10 Hz during a probe costs a third of the
        calls; PCIe throughput, which blocks 20 ms a call, on its own staggered turns."""
        device = poll.device
        fields = self._read_fields(poll)
        for clock, kind in CLOCKS:
            current = poll.get(pynvml.nvmlDeviceGetClockInfo, kind)
            poll.add(
                "gpu_clock_hertz", None if current is None else current * 1e6, ("clock", clock)
            )
        self._read_power(poll, fields)
        energy = poll.get(pynvml.nvmlDeviceGetTotalEnergyConsumption)
        poll.add("gpu_energy_joules_total", None if energy is None else energy / 1000)
        self._read_temperatures(poll, fields)
        rates = poll.get(pynvml.nvmlDeviceGetUtilizationRates)
        if rates is not None:
            poll.add("gpu_utilization_ratio", rates.gpu / 100)
            poll.add("gpu_memory_utilization_ratio", rates.memory / 100)
        self._read_reasons(poll, now)
        self._read_violations(poll, fields)
        self._read_memory_errors(poll, fields)
        self._read_pcie_throughput(poll, now)
        if device.last_full is not None and now - device.last_full < FULL_READ_SECONDS:
            poll.readings.extend(device.slow_readings)
            poll.foreign_pids = device.foreign_pids
            return
        first_slow = len(poll.readings)
        self._read_slow(poll)
        device.slow_readings = tuple(poll.readings[first_slow:])
        device.foreign_pids = poll.foreign_pids
        device.last_full = now

    def _read_slow(self, poll: _Poll) -> None:
        device = poll.device
        poll.add("gpu_info", 1.0, *device.identity[2:])
        poll.add("gpu_healthy", 1.0)
        for clock, kind in CLOCKS:
            maximum = poll.get(pynvml.nvmlDeviceGetMaxClockInfo, kind)
            poll.add(
                "gpu_clock_max_hertz", None if maximum is None else maximum * 1e6, ("clock", clock)
            )
        limit = poll.get(pynvml.nvmlDeviceGetEnforcedPowerLimit)
        poll.add("gpu_power_limit_watts", None if limit is None else limit / 1000)
        for name, threshold in (
            ("slowdown", pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
            ("shutdown", pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
        ):
            poll.add(
                "gpu_temperature_threshold_celsius",
                poll.get(pynvml.nvmlDeviceGetTemperatureThreshold, threshold),
                ("threshold", name),
            )
        memory = poll.get(pynvml.nvmlDeviceGetMemoryInfo, pynvml.nvmlMemory_v2)
        if memory is not None:
            poll.add("gpu_memory_total_bytes", memory.total)
            poll.add("gpu_memory_used_bytes", memory.used)
            poll.add("gpu_memory_reserved_bytes", memory.reserved)
        self._read_pcie(poll)
        fan = poll.get(pynvml.nvmlDeviceGetFanSpeed)
        poll.add("gpu_fan_speed_ratio", None if fan is None else fan / 100)
        state = poll.get(pynvml.nvmlDeviceGetPerformanceState)
        poll.add("gpu_performance_state", state if state in _PSTATES else None)
        self._read_remapped_rows(poll)
        self._read_gpm(
            poll,
            device.gpm,
            lambda sample: self._library.call(pynvml.nvmlGpmSampleGet, device.handle, sample),
        )
        poll.add("gpu_foreign_compute_processes", self._foreign_processes(poll))
        if device.topology:
            poll.add("gpu_topology_info", 1.0, *device.topology)
        self._read_mig(poll)
        with self._lock:
            for xid, count in sorted(device.xid_counts.items()):
                poll.add("gpu_xid_errors_total", count, ("xid", str(xid)))
                poll.add(
                    "gpu_xid_last_seen_timestamp_seconds",
                    device.xid_last_seen[xid],
                    ("xid", str(xid)),
                )

    def _foreign_processes(self, poll: _Poll) -> int | None:
        """How many compute processes on the poll's device are not the agent's (itself and its
        probe children); their pids stay on the poll, for a running probe to yield to."""
        processes = poll.get(pynvml.nvmlDeviceGetComputeRunningProcesses_v3)
        if processes is None:
            return None
        if self._own is None:  # once per poll: the probe children's tree is a /proc scan
            self._own = {os.getpid(), *self._own_pids()}
        foreign = [process.pid for process in processes if process.pid not in self._own]
        poll.foreign_pids = tuple(sorted(set(foreign)))
        return len(foreign)

    def _read_mig(self, poll: _Poll) -> None:
        """MIG mode, and in it the MIG devices' readings (kept on each, sent as their own
        samples): identity, memory, foreign processes, GPM per GPU instance."""
        device = poll.device
        mode = poll.get(pynvml.nvmlDeviceGetMigMode)
        if mode is not None:
            poll.add("gpu_mig_mode", 1.0 if mode[0] else 0.0)
        if not (mode and mode[0]):
            for mig in device.migs:
                self._gpm.drop(mig.gpm)
            device.migs, device.mig_scanned = [], None
            return
        now = time.monotonic()
        if device.mig_scanned is None or now - device.mig_scanned >= MIG_SCAN_SECONDS:
            found = scan(self._library, device.handle, device.index, device.uuid, device.migs)
            kept = {mig.uuid for mig in found}
            for mig in device.migs:
                if mig.uuid not in kept:
                    self._gpm.drop(mig.gpm)
            device.migs, device.mig_scanned = found, now
        # GPM samples a GPU instance whole (nvmlGpmMigSampleGet takes its id; DCGM: "a MIG sample
        # is a GPU-I level aggregation of GPU-CI counters"): its series are exported once, on its
        # MIG device with the lowest compute instance id, not once per compute instance.
        gpm_owners: dict[int, MigDevice] = {}
        for mig in sorted(device.migs, key=lambda mig: mig.compute_instance):
            gpm_owners.setdefault(mig.gpu_instance, mig)
        for mig in device.migs:
            instance = _Poll(self._library, device, mig)
            instance.add(
                "gpu_mig_info",
                1.0,
                ("compute_instance", str(mig.compute_instance)),
                ("name", dict(device.identity)["name"]),
            )
            memory = instance.get(pynvml.nvmlDeviceGetMemoryInfo)
            if memory is not None:
                instance.add("gpu_mig_memory_total_bytes", memory.total)
                instance.add("gpu_mig_memory_used_bytes", memory.used)
            instance.add("gpu_mig_foreign_compute_processes", self._foreign_processes(instance))
            mig.foreign_pids = instance.foreign_pids
            if gpm_owners[mig.gpu_instance] is mig:
                self._read_gpm(
                    instance,
                    mig.gpm,
                    functools.partial(
                        self._library.call,
                        pynvml.nvmlGpmMigSampleGet,
                        device.handle,
                        mig.gpu_instance,
                    ),
                    prefix="gpu_mig_",
                )
            else:
                self._gpm.drop(mig.gpm)
            mig.readings = tuple(instance.readings)
            poll.errors.extend(instance.errors)

    def _read_temperatures(self, poll: _Poll, fields: dict[int, float | None] | None) -> None:
        gpu = poll.first(
            (binding("nvmlDeviceGetTemperatureV"), (pynvml.NVML_TEMPERATURE_GPU,)),
            (pynvml.nvmlDeviceGetTemperature, (pynvml.NVML_TEMPERATURE_GPU,)),
        )
        poll.add("gpu_temperature_celsius", gpu, ("sensor", "gpu"))
        if fields is not None:
            poll.add(
                "gpu_temperature_celsius",
                fields[pynvml.NVML_FI_DEV_MEMORY_TEMP],
                ("sensor", "memory"),
            )

    def _read_power(self, poll: _Poll, fields: dict[int, float | None] | None) -> None:
        """The instant reading is the power gauge: nvmlDeviceGetPowerUsage is a 1 s average on
        Ampere (GA100 excepted) and newer, which smooths the power-brake spikes 10 Hz sampling is
        for. Drivers without the field: nvmlDeviceGetPowerUsage (instantaneous on the older
        GPUs such drivers serve, averaged on newer ones). The driver's average is its own series."""
        instant = None if fields is None else fields[POWER_INSTANT]
        average = None if fields is None else fields[POWER_AVERAGE]
        if instant is None:
            instant = poll.get(pynvml.nvmlDeviceGetPowerUsage)
        poll.add("gpu_power_watts", None if instant is None else instant / 1000)
        poll.add("gpu_power_average_watts", None if average is None else average / 1000)

    def _read_pcie(self, poll: _Poll) -> None:
        poll.add("gpu_pcie_link_generation", poll.get(pynvml.nvmlDeviceGetCurrPcieLinkGeneration))
        poll.add(
            "gpu_pcie_link_generation_max", poll.get(pynvml.nvmlDeviceGetMaxPcieLinkGeneration)
        )
        poll.add("gpu_pcie_link_width", poll.get(pynvml.nvmlDeviceGetCurrPcieLinkWidth))
        poll.add("gpu_pcie_link_width_max", poll.get(pynvml.nvmlDeviceGetMaxPcieLinkWidth))

    def _read_pcie_throughput(self, poll: _Poll, now: float) -> None:
        """PCIe throughput when the GPU's turn has come (see PCIE_THROUGHPUT_SECONDS), else its
        last values again. The first poll reads every GPU; then GPU i of n is read at
        i / n of the period after the others' turns, each on its own grid of the period."""
        device = poll.device
        due = device.pcie_due
        if due is not None and 0 < due - now <= 2 * PCIE_THROUGHPUT_SECONDS:  # not a clock jump
            poll.readings.extend(device.pcie_readings)
            return
        first = len(poll.readings)
        for direction, counter in (
            ("tx", pynvml.NVML_PCIE_UTIL_TX_BYTES),
            ("rx", pynvml.NVML_PCIE_UTIL_RX_BYTES),
        ):
            kilobytes = poll.get(pynvml.nvmlDeviceGetPcieThroughput, counter)
            poll.add(
                "gpu_pcie_throughput_bytes_per_second",
                None if kilobytes is None else kilobytes * _PCIE_BYTES_PER_KB,
                ("direction", direction),
            )
        device.pcie_readings = tuple(poll.readings[first:])
        if due is None:
            turn = self._devices.index(device) / max(1, len(self._devices))
            device.pcie_due = now + (1 + turn) * PCIE_THROUGHPUT_SECONDS
        else:  # the next point of its grid after now
            device.pcie_due = due + ((now - due) // PCIE_THROUGHPUT_SECONDS + 1) * (
                PCIE_THROUGHPUT_SECONDS
            )

    def _read_reasons(self, poll: _Poll, now: float) -> None:
        device = poll.device
        mask = poll.first(
            (pynvml.nvmlDeviceGetCurrentClocksEventReasons, ()),
            (pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, ()),
        )
        # The state seen at the previous poll is taken to have held until this one.
        if device.last_reasons is not None and device.last_poll is not None:
            elapsed = now - device.last_poll
            for reason, bit in REASONS:
                if device.last_reasons & bit:
                    device.reason_seconds[reason] = device.reason_seconds.get(reason, 0.0) + elapsed
        device.last_reasons = None if mask is None else int(mask)
        device.last_poll = now
        if mask is None:
            return
        self._episodes(device, int(mask), now)
        for reason, bit in REASONS:
            poll.add(
                "gpu_clock_event_reason_active", 1.0 if mask & bit else 0.0, ("reason", reason)
            )
            poll.add(
                "gpu_clock_event_reason_seconds_total",
                device.reason_seconds.get(reason, 0.0),
                ("reason", reason),
            )

    def _episodes(self, device: _Device, mask: int, now: float) -> None:
        """Start or end the device's throttle episodes; an ended one becomes an event."""
        for reason, bit in REASONS:
            if reason not in THROTTLE_REASONS:
                continue
            started = device.episode_start.get(reason)
            if mask & bit and started is None:
                device.episode_start[reason] = now
            elif not mask & bit and started is not None:
                del device.episode_start[reason]
                seconds = now - started
                event = Event(
                    "throttle_episode",
                    device.uuid,
                    now,
                    f"GPU {device.index}: {reason} for {seconds:.1f} s",
                    (
                        ("reason", reason),
                        ("started", f"{started:.3f}"),
                        ("seconds", f"{seconds:.3f}"),
                    ),
                )
                with self._lock:
                    self._pending_events.append(event)

    def _read_fields(self, poll: _Poll) -> dict[int, float | None] | None:
        """Every field value the collector uses, in one call (the current API for memory
        temperature, violation counters and ECC totals). None where the driver lacks the call,
        so that the callers use the deprecated calls instead.

        A field the driver answers NVML_ERROR_INVALID_ARGUMENT is one it does not know (185 and
        186, the power fields, on drivers older than them): logged once, never asked again for
        that GPU, absent, and not counted as an error, like NVML_ERROR_NOT_SUPPORTED."""
        device = poll.device
        numbers: dict[int, float | None] = dict.fromkeys(FIELD_IDS)
        asked = [field_id for field_id in FIELD_IDS if field_id not in device.unknown_fields]
        if not asked:
            return numbers
        try:
            values = self._library.call(pynvml.nvmlDeviceGetFieldValues, device.handle, asked)
        except FunctionMissing:
            return None
        except Absent:
            return numbers
        except CallFailed as exc:
            poll.errors.append(exc.kind)
            return numbers
        for field_id, value in zip(asked, values, strict=True):
            if value.nvmlReturn == pynvml.NVML_ERROR_INVALID_ARGUMENT:
                device.unknown_fields.add(field_id)
                log.info(
                    "GPU %d (%s): the driver does not know field %d (NVML_ERROR_INVALID_ARGUMENT): "
                    "not asked again, its series absent",
                    device.index,
                    device.uuid,
                    field_id,
                )
                continue
            # A field's own transient failure (its nvmlReturn) is counted like a call's.
            kind = transient_kind(value.nvmlReturn)
            if kind is not None:
                poll.errors.append(kind)
            numbers[field_id] = _field_number(value)
        return numbers

    def _read_violations(self, poll: _Poll, fields: dict[int, float | None] | None) -> None:
        for policy, field_id, old_policy in POLICIES:
            if fields is not None:
                nanoseconds = fields[field_id]
            else:
                status = poll.get(pynvml.nvmlDeviceGetViolationStatus, old_policy)
                nanoseconds = None if status is None else status.violationTime
            poll.add(
                "gpu_violation_seconds_total",
                None if nanoseconds is None else nanoseconds / 1e9,
                ("policy", policy),
            )

    def _read_memory_errors(self, poll: _Poll, fields: dict[int, float | None] | None) -> None:
        for kind, field_id, error_type in ECC:
            if fields is not None:
                count = fields[field_id]
            else:
                count = poll.get(
                    pynvml.nvmlDeviceGetTotalEccErrors, error_type, pynvml.NVML_AGGREGATE_ECC
                )
            poll.add("gpu_ecc_errors_total", count, ("type", kind))

    def _read_remapped_rows(self, poll: _Poll) -> None:
        rows = poll.get(pynvml.nvmlDeviceGetRemappedRows)
        if rows is not None:
            correctable, uncorrectable, pending, failed = rows
            poll.add("gpu_remapped_rows", correctable, ("cause", "correctable"))
            poll.add("gpu_remapped_rows", uncorrectable, ("cause", "uncorrectable"))
            poll.add("gpu_row_remap_pending", 1.0 if pending else 0.0)
            poll.add("gpu_row_remap_failed", 1.0 if failed else 0.0)

    def _read_gpm(
        self, poll: _Poll, stream: Gpm, take: Callable[[Any], Any], prefix: str = "gpu_"
    ) -> None:
        """The GPM ratios of ``stream`` (the GPU's, or a GPU instance's through ``take``); its
        support starts from the GPU's nvmlGpmQueryDeviceSupport, asked once per acquisition of
        the GPU (see collectors.nvml.gpm)."""
        device = poll.device
        if device.gpm_capable is None:
            device.gpm_capable = self._gpm.supported(device.handle, poll.errors)
        if stream.supported is None:
            stream.supported = device.gpm_capable
        where = (device.index, dict(poll.labels)["uuid"])
        for key, ratio in self._gpm.read(stream, take, poll.errors, where).items():
            poll.add(prefix + key.removeprefix("gpu_"), ratio)

    def close(self) -> None:
        self._xid.stop()
        for device in self._devices:
            for stream in (device.gpm, *(mig.gpm for mig in device.migs)):
                self._gpm.drop(stream)
        self._library.shutdown()
