"""NVIDIA GPUs through NVML (nvidia-ml-py, module ``pynvml``).

Every NVML call goes through ``NvmlLibrary.call``, the one place that knows what an NVML error
means: NotSupported, NoPermission and FunctionNotFound (an older driver) make the field absent
for that device — never 0, never a sentinel — and FunctionNotFound is logged once per function;
GpuIsLost marks the device unhealthy; anything else (a timeout, an unknown error) costs that field
for that sample and is counted. Units are converted here and nowhere else (MHz -> hertz,
mW -> watts, mJ -> joules, percent -> ratio, ns -> seconds, NVML's KB/s, which is KiB/s,
-> bytes/s). The exposition::

    sustain_gpu_clock_hertz{clock="sm",device="0",uuid="GPU-7d3a..."} 1.41e+09
    sustain_gpu_power_watts{device="0",uuid="GPU-7d3a..."} 352.4
    sustain_gpu_clock_event_reason_active{device="1",reason="hw_thermal_slowdown",uuid=...} 1.0
    sustain_gpu_clock_event_reason_seconds_total{device="1",reason="hw_thermal_slowdown",...} 30.0
    sustain_gpu_healthy{device="0",uuid="GPU-7d3a..."} 1.0
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import pynvml

from collectors.base import (
    CollectorError,
    Event,
    Field,
    Labels,
    Reading,
    Sample,
    SourceUnavailable,
)

log = logging.getLogger(__name__)

ID = ("device", "uuid")

# nvmlClocksEventReason* bits, in NVML's order; the label values are the documented names.
REASONS: tuple[tuple[str, int], ...] = (
    ("gpu_idle", 0x1),
    ("applications_clocks_setting", 0x2),
    ("sw_power_cap", 0x4),
    ("hw_slowdown", 0x8),
    ("sync_boost", 0x10),
    ("sw_thermal_slowdown", 0x20),
    ("hw_thermal_slowdown", 0x40),
    ("hw_power_brake_slowdown", 0x80),
    ("display_clock_setting", 0x100),
)
# Reasons that cost throughput: each stretch of one is a ``throttle_episode`` event, written when
# it ends (with its start and length). sw_power_cap is normal under load but is what a capacity
# planner asks about; idle, sync boost and the clock settings are not throttling.
THROTTLE_REASONS = frozenset(
    {"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
     "hw_power_brake_slowdown"}
)  # fmt: skip

# Violation (perf policy) counters: field id of the current API, policy of the deprecated one.
POLICIES: tuple[tuple[str, int, int], ...] = (
    ("power", pynvml.NVML_FI_DEV_PERF_POLICY_POWER, pynvml.NVML_PERF_POLICY_POWER),
    ("thermal", pynvml.NVML_FI_DEV_PERF_POLICY_THERMAL, pynvml.NVML_PERF_POLICY_THERMAL),
    ("sync_boost", pynvml.NVML_FI_DEV_PERF_POLICY_SYNC_BOOST, pynvml.NVML_PERF_POLICY_SYNC_BOOST),
    (
        "board_limit",
        pynvml.NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT,
        pynvml.NVML_PERF_POLICY_BOARD_LIMIT,
    ),
    (
        "low_utilization",
        pynvml.NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION,
        pynvml.NVML_PERF_POLICY_LOW_UTILIZATION,
    ),
    (
        "reliability",
        pynvml.NVML_FI_DEV_PERF_POLICY_RELIABILITY,
        pynvml.NVML_PERF_POLICY_RELIABILITY,
    ),
    (
        "total_app_clocks",
        pynvml.NVML_FI_DEV_PERF_POLICY_TOTAL_APP_CLOCKS,
        pynvml.NVML_PERF_POLICY_TOTAL_APP_CLOCKS,
    ),
    (
        "total_base_clocks",
        pynvml.NVML_FI_DEV_PERF_POLICY_TOTAL_BASE_CLOCKS,
        pynvml.NVML_PERF_POLICY_TOTAL_BASE_CLOCKS,
    ),
)

ECC = (
    ("corrected", pynvml.NVML_FI_DEV_ECC_SBE_AGG_TOTAL, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
    (
        "uncorrected",
        pynvml.NVML_FI_DEV_ECC_DBE_AGG_TOTAL,
        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    ),
)

# Read in one nvmlDeviceGetFieldValues call per device and poll.
FIELD_IDS = (
    pynvml.NVML_FI_DEV_MEMORY_TEMP,
    *(field_id for _, field_id, _ in POLICIES),
    *(field_id for _, field_id, _ in ECC),
)

CLOCKS = (
    ("sm", pynvml.NVML_CLOCK_SM),
    ("memory", pynvml.NVML_CLOCK_MEM),
    ("graphics", pynvml.NVML_CLOCK_GRAPHICS),
)

GPM_METRICS = (
    ("gpu_dram_bandwidth_utilization_ratio", pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL),
    ("gpu_sm_occupancy_ratio", pynvml.NVML_GPM_METRIC_SM_OCCUPANCY),
    ("gpu_tensor_activity_ratio", pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL),
)

# How often a lost device is looked for again, and NVML itself where it could not start.
RETRY_SECONDS = 5.0
FULL_READ_SECONDS = 0.5
INIT_RETRY_SECONDS = 60.0
XID_WAIT_MS = 500

_ERROR_KINDS = {
    pynvml.NVML_ERROR_TIMEOUT: "timeout",
    pynvml.NVML_ERROR_UNKNOWN: "unknown",
    pynvml.NVML_ERROR_INSUFFICIENT_SIZE: "insufficient_size",
    pynvml.NVML_ERROR_INVALID_ARGUMENT: "invalid_argument",
    pynvml.NVML_ERROR_UNINITIALIZED: "uninitialized",
}
_ABSENT = frozenset(
    {
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_NO_PERMISSION,
        pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
        pynvml.NVML_ERROR_NO_DATA,
    }
)
_LOST = frozenset({pynvml.NVML_ERROR_GPU_IS_LOST})


def _gauge(stem: str, unit: str, help_text: str, *labels: str, **flags: bool) -> Field:
    return Field(stem, unit, "gauge", help_text, (*ID, *labels), **flags)


def _counter(stem: str, unit: str, help_text: str, *labels: str) -> Field:
    return Field(stem, unit, "counter", help_text, (*ID, *labels))


_FIELDS = (
    Field(
        "gpu_info",
        "",
        "gauge",
        "Identity of one GPU; value 1. Source: nvmlDeviceGetName, GetPciInfo_v3, GetSerial.",
        (*ID, "name", "pci_bus_id", "serial"),
        rollup=False,
    ),
    Field(
        "nvml_info",
        "",
        "gauge",
        "NVIDIA driver, NVML and CUDA driver versions; value 1. Source: nvmlSystemGet*Version.",
        ("driver_version", "nvml_version", "cuda_driver_version"),
        rollup=False,
    ),
    _gauge("gpu_healthy", "", "1 while the GPU answers, 0 after NVML reported it lost."),
    _gauge(
        "gpu_clock",
        "hertz",
        "Current clock. Source: nvmlDeviceGetClockInfo.",
        "clock",
        windowed=True,
    ),
    _gauge(
        "gpu_clock_max",
        "hertz",
        "Maximum clock. Source: nvmlDeviceGetMaxClockInfo.",
        "clock",
        rollup=False,
    ),
    _gauge("gpu_power", "watts", "Power draw. Source: nvmlDeviceGetPowerUsage.", windowed=True),
    _gauge(
        "gpu_power_limit",
        "watts",
        "Enforced power limit. Source: nvmlDeviceGetEnforcedPowerLimit.",
    ),
    _counter(
        "gpu_energy",
        "joules",
        "Energy used since the driver loaded. Source: nvmlDeviceGetTotalEnergyConsumption.",
    ),
    _gauge(
        "gpu_temperature",
        "celsius",
        "Temperature of the GPU die or its memory. Source: nvmlDeviceGetTemperatureV "
        "(GetTemperature on old drivers); memory: field NVML_FI_DEV_MEMORY_TEMP.",
        "sensor",
        windowed=True,
    ),
    _gauge(
        "gpu_temperature_threshold",
        "celsius",
        "Temperature at which the GPU slows down or shuts down. "
        "Source: nvmlDeviceGetTemperatureThreshold.",
        "threshold",
        rollup=False,
    ),
    _gauge(
        "gpu_utilization",
        "ratio",
        "Share of time a kernel ran (not how busy the SMs were). "
        "Source: nvmlDeviceGetUtilizationRates.",
        windowed=True,
    ),
    _gauge(
        "gpu_memory_utilization",
        "ratio",
        "Share of time device memory was read or written. Source: nvmlDeviceGetUtilizationRates.",
        windowed=True,
    ),
    _gauge(
        "gpu_memory_total",
        "bytes",
        "Device memory. Source: nvmlDeviceGetMemoryInfo_v2.",
        rollup=False,
    ),
    _gauge("gpu_memory_used", "bytes", "Device memory in use. Source: nvmlDeviceGetMemoryInfo_v2."),
    _gauge(
        "gpu_memory_reserved",
        "bytes",
        "Device memory reserved by the driver. Source: nvmlDeviceGetMemoryInfo_v2.",
        rollup=False,
    ),
    _gauge(
        "gpu_pcie_link_generation",
        "",
        "Current PCIe link generation. Source: nvmlDeviceGetCurrPcieLinkGeneration.",
    ),
    _gauge(
        "gpu_pcie_link_generation_max",
        "",
        "Maximum PCIe link generation. Source: nvmlDeviceGetMaxPcieLinkGeneration.",
        rollup=False,
    ),
    _gauge(
        "gpu_pcie_link_width",
        "",
        "Current PCIe link width (lanes). Source: nvmlDeviceGetCurrPcieLinkWidth.",
    ),
    _gauge(
        "gpu_pcie_link_width_max",
        "",
        "Maximum PCIe link width (lanes). Source: nvmlDeviceGetMaxPcieLinkWidth.",
        rollup=False,
    ),
    _gauge(
        "gpu_pcie_throughput",
        "bytes_per_second",
        "PCIe throughput over the driver's last 20 ms. Source: nvmlDeviceGetPcieThroughput.",
        "direction",
        windowed=True,
    ),
    _gauge(
        "gpu_fan_speed",
        "ratio",
        "Fan speed as a share of its maximum. Source: nvmlDeviceGetFanSpeed.",
    ),
    _gauge(
        "gpu_performance_state",
        "",
        "Performance state, 0 (P0, fastest) to 15. Source: nvmlDeviceGetPerformanceState.",
    ),
    _gauge(
        "gpu_clock_event_reason_active",
        "",
        "1 while this reason holds the clocks down, else 0. Source: "
        "nvmlDeviceGetCurrentClocksEventReasons (GetCurrentClocksThrottleReasons on old drivers).",
        "reason",
        windowed=True,
    ),
    _counter(
        "gpu_clock_event_reason",
        "seconds",
        "Time this reason was active, integrated by the agent between its polls. Source: "
        "nvmlDeviceGetCurrentClocksEventReasons.",
        "reason",
    ),
    _counter(
        "gpu_violation",
        "seconds",
        "Time the clocks were held below target by this policy. Source: field values "
        "NVML_FI_DEV_PERF_POLICY_* (nvmlDeviceGetViolationStatus on old drivers).",
        "policy",
    ),
    _counter(
        "gpu_ecc_errors",
        "",
        "ECC errors over the GPU's life (aggregate). Source: field values "
        "NVML_FI_DEV_ECC_SBE_AGG_TOTAL and _DBE_AGG_TOTAL (nvmlDeviceGetTotalEccErrors on old "
        "drivers).",
        "type",
    ),
    _gauge(
        "gpu_remapped_rows",
        "",
        "Memory rows remapped, by cause. Source: nvmlDeviceGetRemappedRows.",
        "cause",
    ),
    _gauge(
        "gpu_row_remap_pending",
        "",
        "1 when a row remap waits for a GPU reset. Source: nvmlDeviceGetRemappedRows.",
    ),
    _gauge(
        "gpu_row_remap_failed",
        "",
        "1 when a row remap failed. Source: nvmlDeviceGetRemappedRows.",
    ),
    _counter(
        "gpu_xid_errors",
        "",
        "Critical XID events since the agent started. Source: nvmlEventSetWait_v2.",
        "xid",
    ),
    _gauge(
        "gpu_xid_last_seen_timestamp",
        "seconds",
        "Unix time this XID was last seen. Source: nvmlEventSetWait_v2.",
        "xid",
        rollup=False,
    ),
    _gauge(
        "gpu_dram_bandwidth_utilization",
        "ratio",
        "DRAM bandwidth used against the peak (Hopper and newer). Source: GPM "
        "NVML_GPM_METRIC_DRAM_BW_UTIL.",
        windowed=True,
    ),
    _gauge(
        "gpu_sm_occupancy",
        "ratio",
        "Active warps against the maximum (Hopper and newer). Source: GPM "
        "NVML_GPM_METRIC_SM_OCCUPANCY.",
        windowed=True,
    ),
    _gauge(
        "gpu_tensor_activity",
        "ratio",
        "Share of time the SMs ran tensor instructions (Hopper and newer). Source: GPM "
        "NVML_GPM_METRIC_ANY_TENSOR_UTIL.",
        windowed=True,
    ),
    _gauge(
        "gpu_foreign_compute_processes",
        "",
        "Compute processes on the GPU other than the agent's own. Source: "
        "nvmlDeviceGetComputeRunningProcesses_v3.",
    ),
)
FIELDS: Mapping[str, Field] = MappingProxyType({f.key: f for f in _FIELDS})


class Absent(Exception):
    """The field does not exist for this device (not supported, no permission, no function)."""


class FunctionMissing(Absent):
    """The driver lacks the function: a caller with an older fallback may use it."""


class DeviceLost(Exception):
    """NVML says the GPU is lost (fallen off the bus)."""


class CallFailed(Exception):
    """A transient NVML failure; ``kind`` names it for the error counter."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class NvmlLibrary:
    """The choke point: lazy init under a lock, shutdown at exit, one meaning per error code."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = False
        self._missing: set[str] = set()
        self._failed_at: float | None = None
        self._failure = ""

    def start(self) -> bool:
        """Initialise NVML once; True the first time it succeeds. Raises SourceUnavailable."""
        with self._lock:
            if self._started:
                return False
            now = time.monotonic()
            if self._failed_at is not None and now - self._failed_at < INIT_RETRY_SECONDS:
                raise SourceUnavailable(self._failure)
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as exc:
                first = self._failed_at is None
                self._failed_at = now
                self._failure = f"NVML unavailable: {exc}"
                if first:
                    log.info(
                        "%s; no GPU telemetry (retried every %.0f s)",
                        self._failure,
                        INIT_RETRY_SECONDS,
                    )
                raise SourceUnavailable(self._failure) from None
            self._started = True
            self._failed_at = None
            atexit.register(self.shutdown)
            return True

    def shutdown(self) -> None:
        with self._lock:
            if not self._started:
                return
            self._started = False
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as exc:
                log.debug("nvmlShutdown: %s", exc)

    def call(self, function: Callable[..., Any], *args: Any) -> Any:
        name = getattr(function, "__name__", repr(function))
        if name in self._missing:
            raise FunctionMissing(name)
        try:
            return function(*args)
        except pynvml.NVMLError as exc:
            code = exc.value
            if code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                if name not in self._missing:
                    self._missing.add(name)
                    log.info("NVML driver lacks %s: its fields are absent", name)
                raise FunctionMissing(name) from None
            if code in _ABSENT:
                raise Absent(name) from None
            if code in _LOST:
                raise DeviceLost(str(exc)) from None
            raise CallFailed(_ERROR_KINDS.get(code, f"nvml_{code}")) from None

    def call_first(self, *calls: tuple[Callable[..., Any], tuple[Any, ...]]) -> Any:
        """The first call whose function the driver has: the current API, then its fallback."""
        for function, args in calls[:-1]:
            try:
                return self.call(function, *args)
            except FunctionMissing:
                continue
        function, args = calls[-1]
        return self.call(function, *args)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


_VALUE_MEMBERS = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}


def _field_number(value: Any) -> float | None:
    """The number in an nvmlFieldValue_t, or None when NVML returned an error for it."""
    member = _VALUE_MEMBERS.get(value.valueType)
    if value.nvmlReturn != pynvml.NVML_SUCCESS or member is None:
        return None
    return float(getattr(value.value, member))


def _handle_key(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


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
    gpm_sample: Any = None
    gpm_supported: bool | None = None
    last_full: float | None = None
    slow_readings: tuple[Reading, ...] = ()
    xid_counts: Counter[int] = field(default_factory=Counter)
    xid_last_seen: dict[int, float] = field(default_factory=dict)


class _Poll:
    """Readings and error kinds of one device during one poll."""

    __slots__ = ("device", "errors", "library", "readings")

    def __init__(self, library: NvmlLibrary, device: _Device) -> None:
        self.library = library
        self.device = device
        self.readings: list[Reading] = []
        self.errors: list[str] = []

    def add(self, key: str, value: float | None, *labels: tuple[str, str]) -> None:
        if value is not None:
            self.readings.append(Reading(key, float(value), (*self.device.labels, *labels)))

    def get(self, function: Callable[..., Any], *args: Any) -> Any:
        """The call's result, or None when the field is absent or the call failed this time."""
        try:
            return self.library.call(function, self.device.handle, *args)
        except Absent:
            return None
        except CallFailed as exc:
            self.errors.append(exc.kind)
            return None

    def first(self, *calls: tuple[Callable[..., Any], tuple[Any, ...]]) -> Any:
        handle = self.device.handle
        try:
            return self.library.call_first(*((fn, (handle, *args)) for fn, args in calls))
        except Absent:
            return None
        except CallFailed as exc:
            self.errors.append(exc.kind)
            return None


class _XidWatcher:
    """Waits on an NVML event set in its own thread, so the sampler never blocks on it."""

    def __init__(self, library: NvmlLibrary, on_xid: Callable[[int | None, int], None]) -> None:
        self._library = library
        self._on_xid = on_xid
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None

    def start(self, handles: Sequence[Any]) -> None:
        try:
            self._event_set = self._library.call(pynvml.nvmlEventSetCreate)
        except (Absent, CallFailed) as exc:
            log.info("XID events unavailable: %s", exc)
            return
        for handle in handles:
            self.register(handle)
        self._thread = threading.Thread(target=self._run, name="nvml-xid", daemon=True)
        self._thread.start()

    def register(self, handle: Any) -> None:
        if self._event_set is None:
            return
        try:
            supported = self._library.call(pynvml.nvmlDeviceGetSupportedEventTypes, handle)
            if supported & pynvml.nvmlEventTypeXidCriticalError:
                self._library.call(
                    pynvml.nvmlDeviceRegisterEvents,
                    handle,
                    pynvml.nvmlEventTypeXidCriticalError,
                    self._event_set,
                )
        except (Absent, CallFailed, DeviceLost) as exc:
            log.info("XID events not registered for a device: %s", exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._library.call(pynvml.nvmlEventSetWait_v2, self._event_set, XID_WAIT_MS)
            except CallFailed as exc:
                if exc.kind != "timeout":
                    self._stop.wait(1.0)  # do not spin on a persistent failure
                continue
            except (Absent, DeviceLost):
                self._stop.wait(1.0)
                continue
            if data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                self._on_xid(_handle_key(data.device), int(data.eventData))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(XID_WAIT_MS / 1000 * 4)
        if self._event_set is not None:
            with contextlib.suppress(Absent, CallFailed):
                self._library.call(pynvml.nvmlEventSetFree, self._event_set)
            self._event_set = None


class NvmlCollector:
    """All GPUs NVML sees; one sample per GPU per poll, plus one for the driver versions."""

    name = "nvml"

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        own_pids: Callable[[], set[int]] = set,
    ) -> None:
        """``clock`` gives sample timestamps and the time the reason counters integrate; tests
        pass the fake driver's scaled clock so that hours of scenario run in minutes.
        ``own_pids`` are the agent's probe children: not foreign work on a GPU."""
        self._clock = clock
        self._own_pids = own_pids
        self._library = NvmlLibrary()
        self._devices: list[_Device] = []
        self._system: tuple[Reading, ...] = ()
        self._lock = threading.Lock()  # devices' XID state is written by the watcher thread
        self._xid = _XidWatcher(self._library, self._record_xid)
        self._pending_events: list[Event] = []

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
        for function in (
            pynvml.nvmlSystemGetDriverVersion,
            pynvml.nvmlSystemGetNVMLVersion,
            pynvml.nvmlSystemGetCudaDriverVersion,
        ):
            try:
                versions.append(_text(library.call(function)))
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
            try:
                handle = library.call(pynvml.nvmlDeviceGetHandleByIndex, index)
                uuid = _text(library.call(pynvml.nvmlDeviceGetUUID, handle))
            except (Absent, CallFailed, DeviceLost) as exc:
                log.warning("GPU %d: cannot identify it (%s); skipped until restart", index, exc)
                continue
            self._devices.append(self._identify(index, uuid, handle))
        log.info(
            "NVML: driver %s, %d GPU(s): %s",
            versions[0] or "unknown",
            len(self._devices),
            ", ".join(dict(d.identity)["name"] for d in self._devices) or "none",
        )
        self._xid.start([device.handle for device in self._devices])

    def _identify(self, index: int, uuid: str, handle: Any) -> _Device:
        def text(function: Callable[..., Any]) -> str:
            try:
                return _text(self._library.call(function, handle))
            except (Absent, CallFailed, DeviceLost):
                return ""

        try:
            pci = self._library.call(pynvml.nvmlDeviceGetPciInfo_v3, handle)
            bus_id = _text(pci.busId)
        except (Absent, CallFailed, DeviceLost):
            bus_id = ""
        labels = (("device", str(index)), ("uuid", uuid))
        identity = (
            *labels,
            ("name", text(pynvml.nvmlDeviceGetName)),
            ("pci_bus_id", bus_id),
            ("serial", text(pynvml.nvmlDeviceGetSerial)),
        )
        return _Device(index=index, uuid=uuid, handle=handle, identity=identity, labels=labels)

    def _record_xid(self, handle_key: int | None, xid: int) -> None:
        timestamp = self._clock()
        with self._lock:
            for device in self._devices:
                if _handle_key(device.handle) == handle_key:
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
        samples = [Sample(self.name, "system", now, self._system)]
        for device in self._devices:
            samples.append(self._poll_device(device, now))
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
            device.last_poll = None
            device.last_reasons = None
            device.gpm_sample = None
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
            self.name, device.uuid, now, tuple(poll.readings), tuple(poll.errors), tuple(events)
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
        self._xid.register(handle)
        return True

    def _read(self, poll: _Poll, now: float) -> None:
        """The fast fields (clocks, power, energy, temperatures, utilization, reasons, the field
        values) on every poll; the slow ones (identity, limits, memory, PCIe, fan, P-state, row
        remapping, GPM, processes) at most every FULL_READ_SECONDS, their last values repeated
        in between, so that sampling at 10 Hz during a probe costs a third of the calls."""
        device = poll.device
        fields = self._read_fields(poll)
        for clock, kind in CLOCKS:
            current = poll.get(pynvml.nvmlDeviceGetClockInfo, kind)
            poll.add(
                "gpu_clock_hertz", None if current is None else current * 1e6, ("clock", clock)
            )
        power = poll.get(pynvml.nvmlDeviceGetPowerUsage)
        poll.add("gpu_power_watts", None if power is None else power / 1000)
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
        if device.last_full is not None and now - device.last_full < FULL_READ_SECONDS:
            poll.readings.extend(device.slow_readings)
            return
        first_slow = len(poll.readings)
        self._read_slow(poll)
        device.slow_readings = tuple(poll.readings[first_slow:])
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
        poll.add("gpu_performance_state", poll.get(pynvml.nvmlDeviceGetPerformanceState))
        self._read_remapped_rows(poll)
        self._read_gpm(poll)
        processes = poll.get(pynvml.nvmlDeviceGetComputeRunningProcesses_v3)
        if processes is not None:
            own = {os.getpid(), *self._own_pids()}
            poll.add("gpu_foreign_compute_processes", sum(1 for p in processes if p.pid not in own))
        with self._lock:
            for xid, count in sorted(device.xid_counts.items()):
                poll.add("gpu_xid_errors_total", count, ("xid", str(xid)))
                poll.add(
                    "gpu_xid_last_seen_timestamp_seconds",
                    device.xid_last_seen[xid],
                    ("xid", str(xid)),
                )

    def _read_temperatures(self, poll: _Poll, fields: dict[int, float | None] | None) -> None:
        gpu = poll.first(
            (pynvml.nvmlDeviceGetTemperatureV, (pynvml.NVML_TEMPERATURE_GPU,)),
            (pynvml.nvmlDeviceGetTemperature, (pynvml.NVML_TEMPERATURE_GPU,)),
        )
        poll.add("gpu_temperature_celsius", gpu, ("sensor", "gpu"))
        if fields is not None:
            poll.add(
                "gpu_temperature_celsius",
                fields[pynvml.NVML_FI_DEV_MEMORY_TEMP],
                ("sensor", "memory"),
            )

    def _read_pcie(self, poll: _Poll) -> None:
        poll.add("gpu_pcie_link_generation", poll.get(pynvml.nvmlDeviceGetCurrPcieLinkGeneration))
        poll.add(
            "gpu_pcie_link_generation_max", poll.get(pynvml.nvmlDeviceGetMaxPcieLinkGeneration)
        )
        poll.add("gpu_pcie_link_width", poll.get(pynvml.nvmlDeviceGetCurrPcieLinkWidth))
        poll.add("gpu_pcie_link_width_max", poll.get(pynvml.nvmlDeviceGetMaxPcieLinkWidth))
        for direction, counter in (
            ("tx", pynvml.NVML_PCIE_UTIL_TX_BYTES),
            ("rx", pynvml.NVML_PCIE_UTIL_RX_BYTES),
        ):
            kilobytes = poll.get(pynvml.nvmlDeviceGetPcieThroughput, counter)
            poll.add(
                "gpu_pcie_throughput_bytes_per_second",
                None if kilobytes is None else kilobytes * 1024,
                ("direction", direction),
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
        so that the callers use the deprecated calls instead."""
        try:
            values = self._library.call(
                pynvml.nvmlDeviceGetFieldValues, poll.device.handle, list(FIELD_IDS)
            )
        except FunctionMissing:
            return None
        except Absent:
            return dict.fromkeys(FIELD_IDS)
        except CallFailed as exc:
            poll.errors.append(exc.kind)
            return dict.fromkeys(FIELD_IDS)
        return {
            field_id: _field_number(value)
            for field_id, value in zip(FIELD_IDS, values, strict=True)
        }

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

    def _read_gpm(self, poll: _Poll) -> None:
        """GPM metrics compare two samples: the previous poll's and this one's."""
        device = poll.device
        if device.gpm_supported is None:
            support = poll.get(pynvml.nvmlGpmQueryDeviceSupport)
            device.gpm_supported = bool(support is not None and support.isSupportedDevice)
        if not device.gpm_supported:
            return
        try:
            current = self._library.call(pynvml.nvmlGpmSampleAlloc)
            self._library.call(pynvml.nvmlGpmSampleGet, device.handle, current)
        except (Absent, CallFailed) as exc:
            if isinstance(exc, CallFailed):
                poll.errors.append(exc.kind)
            return
        previous, device.gpm_sample = device.gpm_sample, current
        if previous is None:
            return
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRICS)
        request.sample1 = previous
        request.sample2 = current
        for position, (_, metric_id) in enumerate(GPM_METRICS):
            request.metrics[position].metricId = metric_id
        try:
            self._library.call(pynvml.nvmlGpmMetricsGet, request)
        except (Absent, CallFailed) as exc:
            if isinstance(exc, CallFailed):
                poll.errors.append(exc.kind)
            return
        finally:
            self._library.call(pynvml.nvmlGpmSampleFree, previous)
        for position, (key, _) in enumerate(GPM_METRICS):
            metric = request.metrics[position]
            if metric.nvmlReturn == pynvml.NVML_SUCCESS:
                poll.add(key, metric.value / 100)

    def close(self) -> None:
        self._xid.stop()
        for device in self._devices:
            if device.gpm_sample is not None:
                with contextlib.suppress(Absent, CallFailed, DeviceLost):
                    self._library.call(pynvml.nvmlGpmSampleFree, device.gpm_sample)
                device.gpm_sample = None
        self._library.shutdown()
