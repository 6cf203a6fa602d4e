"""The catalogue of what the NVML collector exports, and the NVML constants behind its labels.

Every family (type, unit, help, labels, windowed, rolled up) is declared once, apart from the code
that reads the driver: the exporter and the rollups get it through ``NvmlCollector.fields``.
Beside it, the tables that tie label values to NVML's constants (clocks, clock-event reason bits,
violation policies, ECC counters, GPM metrics), so that a new label value is added in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import pynvml

from collectors.base import BOTH, MEAN, PEAK, Field, WindowStat

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

# Power: the instant reading is the gauge; nvmlDeviceGetPowerUsage (a 1 s average on Ampere,
# GA100 excepted, and newer: NVML docs) is the fallback on drivers without the field.
POWER_INSTANT = pynvml.NVML_FI_DEV_POWER_INSTANT
POWER_AVERAGE = pynvml.NVML_FI_DEV_POWER_AVERAGE

# Read in one nvmlDeviceGetFieldValues call per device and poll.
FIELD_IDS = (
    POWER_INSTANT,
    POWER_AVERAGE,
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


def _gauge(
    stem: str,
    unit: str,
    help_text: str,
    *labels: str,
    windowed: tuple[WindowStat, ...] = (),
    rollup: bool = True,
) -> Field:
    return Field(stem, unit, "gauge", help_text, (*ID, *labels), windowed=windowed, rollup=rollup)


def _counter(stem: str, unit: str, help_text: str, *labels: str) -> Field:
    return Field(stem, unit, "counter", help_text, (*ID, *labels))


# A MIG device (one compute instance of a MIG-enabled GPU): ``device`` is the parent GPU's index,
# ``uuid`` the instance's own MIG-... UUID (what CUDA_VISIBLE_DEVICES takes), ``parent`` the
# GPU's UUID and ``mig_instance`` its GPU instance id: at most 7 series per family and GPU.
MIG_ID = (*ID, "parent", "mig_instance")


def _mig_gauge(stem: str, unit: str, help_text: str) -> Field:
    return Field(stem, unit, "gauge", help_text, MIG_ID)


_MIG_FIELDS = (
    Field(
        "gpu_mig_info",
        "",
        "gauge",
        "Identity of one MIG device; value 1. Source: nvmlDeviceGetMigDeviceHandleByIndex, "
        "GetUUID, GetGpuInstanceId, GetComputeInstanceId, GetName.",
        (*MIG_ID, "compute_instance", "name"),
        rollup=False,
    ),
    _mig_gauge(
        "gpu_mig_memory_total", "bytes", "The MIG device's memory. Source: nvmlDeviceGetMemoryInfo."
    ),
    _mig_gauge(
        "gpu_mig_memory_used",
        "bytes",
        "Memory in use on the MIG device. Source: nvmlDeviceGetMemoryInfo.",
    ),
    _mig_gauge(
        "gpu_mig_foreign_compute_processes",
        "",
        "Compute processes on the MIG device other than the agent's own. Source: "
        "nvmlDeviceGetComputeRunningProcesses_v3 on the MIG handle.",
    ),
    *(
        _mig_gauge(
            stem,
            "ratio",
            f"{text} Once per GPU instance, on its lowest compute instance. Source: GPM, "
            "nvmlGpmMigSampleGet.",
        )
        for stem, text in (
            ("gpu_mig_dram_bandwidth_utilization", "The instance's DRAM bandwidth use."),
            ("gpu_mig_sm_occupancy", "The instance's active warps against the maximum."),
            ("gpu_mig_tensor_activity", "The instance's tensor-instruction activity."),
        )
    ),
)

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
        windowed=BOTH,
    ),
    _gauge(
        "gpu_clock_max",
        "hertz",
        "Maximum clock. Source: nvmlDeviceGetMaxClockInfo.",
        "clock",
        rollup=False,
    ),
    _gauge(
        "gpu_power",
        "watts",
        "Power draw, instantaneous. Source: field NVML_FI_DEV_POWER_INSTANT; on drivers without "
        "it nvmlDeviceGetPowerUsage (a 1 s average on Ampere and newer, GA100 excepted).",
        windowed=BOTH,
    ),
    _gauge(
        "gpu_power_average",
        "watts",
        "Power draw averaged by the driver over 1 s. Source: field NVML_FI_DEV_POWER_AVERAGE.",
    ),
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
        windowed=PEAK,
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
        windowed=BOTH,
    ),
    _gauge(
        "gpu_memory_utilization",
        "ratio",
        "Share of time device memory was read or written. Source: nvmlDeviceGetUtilizationRates.",
        windowed=BOTH,
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
        "PCIe throughput over a 20 ms sample, each GPU read about once a second. Source: "
        "nvmlDeviceGetPcieThroughput (KB/s, x 1000).",
        "direction",
        windowed=MEAN,
    ),
    _gauge(
        "gpu_fan_speed",
        "ratio",
        "Fan speed as a share of its maximum. Source: nvmlDeviceGetFanSpeed.",
    ),
    _gauge(
        "gpu_performance_state",
        "",
        "Performance state, 0 (P0, fastest) to 15; absent while NVML says unknown. Source: "
        "nvmlDeviceGetPerformanceState.",
    ),
    _gauge(
        "gpu_clock_event_reason_active",
        "",
        "1 while this reason holds the clocks down, else 0. Source: "
        "nvmlDeviceGetCurrentClocksEventReasons (GetCurrentClocksThrottleReasons on old drivers).",
        "reason",
        windowed=PEAK,
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
        windowed=MEAN,
    ),
    _gauge(
        "gpu_sm_occupancy",
        "ratio",
        "Active warps against the maximum (Hopper and newer). Source: GPM "
        "NVML_GPM_METRIC_SM_OCCUPANCY.",
        windowed=MEAN,
    ),
    _gauge(
        "gpu_tensor_activity",
        "ratio",
        "Share of time the SMs ran tensor instructions (Hopper and newer). Source: GPM "
        "NVML_GPM_METRIC_ANY_TENSOR_UTIL.",
        windowed=MEAN,
    ),
    _gauge(
        "gpu_foreign_compute_processes",
        "",
        "Compute processes on the GPU other than the agent's own. Source: "
        "nvmlDeviceGetComputeRunningProcesses_v3.",
    ),
    Field(
        "gpu_topology_info",
        "",
        "gauge",
        "The CPUs and NUMA node nearest the GPU, to which its probes are bound; value 1. "
        "Source: nvmlDeviceGetCpuAffinityWithinScope, nvmlDeviceGetNumaNodeId.",
        (*ID, "cpu_affinity", "numa_node"),
        rollup=False,
    ),
    _gauge(
        "gpu_mig_mode",
        "",
        "1 while MIG mode is on (the GPU is used through its instances), 0 when off. Source: "
        "nvmlDeviceGetMigMode (current mode).",
        rollup=False,
    ),
    *_MIG_FIELDS,
)
FIELDS: Mapping[str, Field] = MappingProxyType({f.key: f for f in _FIELDS})
