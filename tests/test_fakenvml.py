"""The fake NVML library, exercised through the real nvidia-ml-py bindings.

Every test drives the library the way the agent will: ``import pynvml`` and its wrappers, never
the C functions directly (the few exceptions reach states that pynvml's wrappers never produce,
and go through pynvml's own function pointers and structures). Scenario time is pinned with
FAKENVML_EPOCH and compressed with FAKENVML_TIME_SCALE, so the file runs in seconds.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
import pytest
from fakenvml.build import BuildError, build, exported_functions, preload

SCENARIOS = Path(__file__).parent / "fakenvml" / "scenarios"
NS = 1_000_000_000
GIB = 1 << 30

# Entry points that concern no single device (lost-GPU faults cannot reach them).
SYSTEM_FUNCTIONS = {
    "nvmlInit_v2",
    "nvmlInitWithFlags",
    "nvmlShutdown",
    "nvmlErrorString",
    "nvmlSystemGetDriverVersion",
    "nvmlSystemGetNVMLVersion",
    "nvmlSystemGetCudaDriverVersion",
    "nvmlSystemGetCudaDriverVersion_v2",
    "nvmlDeviceGetCount_v2",
    "nvmlEventSetCreate",
    "nvmlEventSetWait_v2",
    "nvmlEventSetFree",
    "nvmlGpmSampleAlloc",
    "nvmlGpmSampleFree",
}


@pytest.fixture(scope="session")
def fake_library(fake_nvml: Path) -> Path:
    """The copy conftest built and loaded. One copy per process: ctypes.CDLL of this path then
    reaches the very library pynvml binds, where another path would load a second copy."""
    preload(fake_nvml)  # the same path again: the library already loaded, no new copy
    return fake_nvml


class FakeGpus:
    """Starts scenarios: writes the file, pins the epoch, initialises NVML; stops them all."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self._tmp_path = tmp_path
        self._monkeypatch = monkeypatch
        self._files = 0
        self._inits = 0
        self.epoch = 0.0
        self.time_scale = 1.0

    def write(self, text: str) -> Path:
        self._files += 1
        path = self._tmp_path / f"scenario{self._files}.scn"
        path.write_text(text)
        return path

    def point_at(
        self, scenario: str | Path, *, at: float = 0.0, time_scale: float | None = 1.0
    ) -> Path:
        """Set the environment for the next nvmlInit: scenario time ``at`` now.

        ``time_scale=None`` leaves the file's ``set time_scale`` in force (then ``at`` is 0).
        """
        path = scenario if isinstance(scenario, Path) else self.write(scenario)
        self._monkeypatch.setenv("FAKENVML_SCENARIO", str(path))
        if time_scale is None:
            assert at == 0
            self._monkeypatch.delenv("FAKENVML_TIME_SCALE", raising=False)
        else:
            self._monkeypatch.setenv("FAKENVML_TIME_SCALE", repr(time_scale))
        self.time_scale = time_scale or 1.0
        self.epoch = time.time() - at / self.time_scale
        self._monkeypatch.setenv("FAKENVML_EPOCH", repr(self.epoch))
        return path

    def start(
        self, scenario: str | Path, *, at: float = 0.0, time_scale: float | None = 1.0
    ) -> Path:
        path = self.point_at(scenario, at=at, time_scale=time_scale)
        self.init()
        return path

    def init(self) -> None:
        pynvml.nvmlInit()
        self._inits += 1

    def shutdown(self) -> None:
        pynvml.nvmlShutdown()
        self._inits -= 1

    def stop(self) -> None:
        while self._inits > 0:
            self.shutdown()

    def now(self) -> float:
        return (time.time() - self.epoch) * self.time_scale

    def sleep_until(self, t: float) -> None:
        time.sleep(max(0.0, self.epoch + t / self.time_scale - time.time()))


@pytest.fixture
def gpus(fake_library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGpus]:
    fake = FakeGpus(tmp_path, monkeypatch)
    yield fake
    fake.stop()


def handle(index: int) -> Any:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def fields(device: Any, ids: list[int]) -> dict[int, Any]:
    return {value.fieldId: value for value in pynvml.nvmlDeviceGetFieldValues(device, ids)}


def gpm_metrics(sample1: Any, sample2: Any, ids: list[int]) -> Any:
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = len(ids)
    request.sample1 = sample1
    request.sample2 = sample2
    for i, metric_id in enumerate(ids):
        request.metrics[i].metricId = metric_id
    return pynvml.nvmlGpmMetricsGet(request)


def raw(name: str) -> Any:
    """pynvml's own pointer to an entry point, for arguments its wrappers never pass."""
    return pynvml._nvmlGetFunctionPointer(name)


def test_struct_layouts_of_this_pynvml_match_the_fake() -> None:
    """The sizes nvml_abi.h asserts at compile time are the ones pynvml's ctypes builds."""
    assert ctypes.sizeof(pynvml.nvmlPciInfo_t) == 68
    assert ctypes.sizeof(pynvml.c_nvmlMemory_v2_t) == 40
    assert pynvml.nvmlMemory_v2 == 0x02000028
    assert ctypes.sizeof(pynvml.c_nvmlTemperature_v1_t) == 12
    assert pynvml.nvmlTemperature_v1 == 0x0100000C
    assert ctypes.sizeof(pynvml.c_nvmlFieldValue_t) == 40
    assert ctypes.sizeof(pynvml.c_nvmlProcessInfo_v3_t) == 24
    assert ctypes.sizeof(pynvml.c_nvmlEventData_t) == 32
    assert ctypes.sizeof(pynvml.c_nvmlGpmMetric_t) == 40
    assert pynvml.c_nvmlGpmMetricsGet_t.metrics.offset == 24
    assert pynvml.NVML_GPM_METRIC_MAX == 477
    assert pynvml.NVML_GPM_SUPPORT_VERSION == pynvml.NVML_GPM_METRICS_GET_VERSION == 1


def test_identity_and_limits_of_the_shipped_two_gpu_scenario(gpus: FakeGpus) -> None:
    gpus.start(SCENARIOS / "two_gpus.scn")
    assert pynvml.nvmlDeviceGetCount() == 2
    assert pynvml.nvmlSystemGetDriverVersion() == "550.54.15"
    assert pynvml.nvmlSystemGetNVMLVersion() == "12.550.54.15"
    assert pynvml.nvmlSystemGetCudaDriverVersion() == 12040
    assert pynvml.nvmlSystemGetCudaDriverVersion_v2() == 12040

    gpu = handle(1)
    assert pynvml.nvmlDeviceGetIndex(gpu) == 1
    assert pynvml.nvmlDeviceGetName(gpu) == "NVIDIA H100 80GB HBM3"
    uuid = pynvml.nvmlDeviceGetUUID(gpu)
    assert uuid == "GPU-2b9e41c7-88d0-4a6b-b3f2-91c04e7a5d02"
    assert pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(uuid)) == 1
    assert pynvml.nvmlDeviceGetSerial(gpu) == "1652123456790"
    assert pynvml.nvmlDeviceGetVbiosVersion(gpu) == "96.00.99.00.01"
    assert pynvml.nvmlDeviceGetBoardPartNumber(gpu) == "692-2G520-0200-000"
    pci = pynvml.nvmlDeviceGetPciInfo(gpu)
    assert (pci.busId, pci.busIdLegacy) == ("00000000:2A:00.0", "0000:2A:00.0")
    assert (pci.domain, pci.bus, pci.device) == (0, 0x2A, 0)
    assert (pci.pciDeviceId, pci.pciSubSystemId) == (0x233010DE, 0x16C110DE)
    assert pynvml.nvmlDeviceGetCudaComputeCapability(gpu) == (9, 0)
    assert pynvml.nvmlDeviceGetArchitecture(gpu) == pynvml.NVML_DEVICE_ARCH_HOPPER

    assert pynvml.nvmlDeviceGetMaxClockInfo(gpu, pynvml.NVML_CLOCK_SM) == 1980
    assert pynvml.nvmlDeviceGetMaxClockInfo(gpu, pynvml.NVML_CLOCK_GRAPHICS) == 1980
    assert pynvml.nvmlDeviceGetMaxClockInfo(gpu, pynvml.NVML_CLOCK_MEM) == 2619
    assert pynvml.nvmlDeviceGetEnforcedPowerLimit(gpu) == 700_000
    assert pynvml.nvmlDeviceGetPowerManagementLimit(gpu) == 700_000
    slowdown = pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
    shutdown = pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN
    assert pynvml.nvmlDeviceGetTemperatureThreshold(gpu, slowdown) == 87
    assert pynvml.nvmlDeviceGetTemperatureThreshold(gpu, shutdown) == 92
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetTemperatureThreshold(gpu, pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX)
    assert pynvml.nvmlDeviceGetMaxPcieLinkGeneration(gpu) == 5
    assert pynvml.nvmlDeviceGetMaxPcieLinkWidth(gpu) == 16
    assert pynvml.nvmlDeviceGetCurrPcieLinkGeneration(gpu) == 5
    assert pynvml.nvmlDeviceGetCurrPcieLinkWidth(gpu) == 16
    memory = pynvml.nvmlDeviceGetMemoryInfo(gpu, version=pynvml.nvmlMemory_v2)
    assert memory.total == 80 * GIB
    assert pynvml.nvmlDeviceGetSupportedClocksEventReasons(gpu) == (pynvml.nvmlClocksEventReasonAll)
    assert pynvml.nvmlDeviceGetSupportedClocksThrottleReasons(gpu) == 0x1FF
    assert pynvml.nvmlDeviceGetSupportedEventTypes(gpu) & pynvml.nvmlEventTypeXidCriticalError
    with pytest.raises(pynvml.NVMLError_NotSupported) as not_supported:
        pynvml.nvmlDeviceGetFanSpeed(gpu)
    assert str(not_supported.value) == "Not Supported"


def test_the_shipped_two_gpu_scenario_goes_from_idle_to_power_capped_load(gpus: FakeGpus) -> None:
    gpus.start(SCENARIOS / "two_gpus.scn", at=5)
    gpu = handle(0)
    assert pynvml.nvmlDeviceGetClockInfo(gpu, pynvml.NVML_CLOCK_SM) == 345
    assert pynvml.nvmlDeviceGetPowerUsage(gpu) == 71_000
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(gpu) == (
        pynvml.nvmlClocksEventReasonGpuIdle
    )
    assert pynvml.nvmlDeviceGetComputeRunningProcesses(gpu) == []
    gpus.stop()

    gpus.start(SCENARIOS / "two_gpus.scn", at=25)
    gpu = handle(0)
    assert pynvml.nvmlDeviceGetClockInfo(gpu, pynvml.NVML_CLOCK_SM) == 1980
    assert pynvml.nvmlDeviceGetPowerUsage(gpu) == 520_000
    assert pynvml.nvmlDeviceGetUtilizationRates(gpu).gpu == 100
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(gpu) == 0
    (process,) = pynvml.nvmlDeviceGetComputeRunningProcesses(gpu)
    assert (process.pid, process.usedGpuMemory) == (4242, 72 * GIB)
    gpus.stop()

    gpus.start(SCENARIOS / "two_gpus.scn", at=45)
    for index in (0, 1):
        gpu = handle(index)
        assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(gpu) == (
            pynvml.nvmlClocksEventReasonSwPowerCap
        )
        assert pynvml.nvmlDeviceGetPowerUsage(gpu) > 698_000
        power = pynvml.nvmlDeviceGetViolationStatus(gpu, pynvml.NVML_PERF_POLICY_POWER)
        assert 5 * NS <= power.violationTime < 6 * NS


EVERY_KEY = """
device 0 name "Test GPU" uuid GPU-00000000-1111-2222-3333-444444444444 serial 0420
device 0 pci_bus_id 0001:c3:1f.2 vbios_version 1.2.3 board_part_number PN-1
device 0 pci_device_id 0x12345678 pci_subsystem_id 0x9abcdef0 supported_reasons 0xff
device 0 supported_event_types 0x8
at 0 0 compute_capability_major 8 compute_capability_minor 6 architecture 7
at 0 0 memory_total_bytes 1000 memory_reserved_bytes 100 memory_used_bytes 300
at 0 0 max_sm_clock_mhz 2001 max_mem_clock_mhz 2002 max_graphics_clock_mhz 2003
at 0 0 max_video_clock_mhz 2004 sm_clock_mhz 1001 mem_clock_mhz 1002 graphics_clock_mhz 1003
at 0 0 video_clock_mhz 1004 power_mw 123456 power_limit_mw 654321 gpu_temp_c 61 mem_temp_c 62
at 0 0 slowdown_temp_c 81 shutdown_temp_c 91 gpu_util_pct 41 mem_util_pct 42 pcie_gen 3
at 0 0 pcie_width 8 max_pcie_gen 4 max_pcie_width 16 pcie_tx_kbps 5000 pcie_rx_kbps 6000
at 0 0 fan_pct 55 pstate 2 reasons 0x24 ecc_corrected 7 ecc_uncorrected 1
at 0 0 remapped_corrected 3 remapped_uncorrected 2 remapped_pending 1 remapped_failure 0
at 10 0 sm_clock_mhz 1501 graphics_clock_mhz 1503 power_mw 223456 gpu_temp_c 71 fan_pct 65
at 10 0 memory_used_bytes 500 pstate 0 reasons 0x0 ecc_corrected 9 remapped_failure 1
at 10 0 gpu_util_pct 99 pcie_tx_kbps 7000 max_pcie_width 8
"""


def test_every_key_reaches_its_function_in_nvml_units(gpus: FakeGpus) -> None:
    gpus.start(EVERY_KEY, at=5)
    gpu = handle(0)
    assert pynvml.nvmlDeviceGetName(gpu) == "Test GPU"
    assert pynvml.nvmlDeviceGetSerial(gpu) == "0420"
    assert pynvml.nvmlDeviceGetVbiosVersion(gpu) == "1.2.3"
    assert pynvml.nvmlDeviceGetBoardPartNumber(gpu) == "PN-1"
    pci = pynvml.nvmlDeviceGetPciInfo(gpu)
    assert (pci.busId, pci.busIdLegacy) == ("00000001:C3:1F.2", "0001:C3:1F.2")
    assert (pci.domain, pci.bus, pci.device) == (1, 0xC3, 0x1F)
    assert (pci.pciDeviceId, pci.pciSubSystemId) == (0x12345678, 0x9ABCDEF0)
    assert pynvml.nvmlDeviceGetCudaComputeCapability(gpu) == (8, 6)
    assert pynvml.nvmlDeviceGetArchitecture(gpu) == pynvml.NVML_DEVICE_ARCH_AMPERE
    memory = pynvml.nvmlDeviceGetMemoryInfo(gpu)
    assert (memory.total, memory.used, memory.free) == (1000, 400, 600)
    memory_v2 = pynvml.nvmlDeviceGetMemoryInfo(gpu, version=pynvml.nvmlMemory_v2)
    assert (memory_v2.total, memory_v2.reserved, memory_v2.used, memory_v2.free) == (
        1000,
        100,
        300,
        600,
    )
    clocks = [pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_MEM, pynvml.NVML_CLOCK_GRAPHICS]
    clocks.append(pynvml.NVML_CLOCK_VIDEO)
    assert [pynvml.nvmlDeviceGetMaxClockInfo(gpu, c) for c in clocks] == [2001, 2002, 2003, 2004]
    assert [pynvml.nvmlDeviceGetClockInfo(gpu, c) for c in clocks] == [1001, 1002, 1003, 1004]
    assert pynvml.nvmlDeviceGetPowerUsage(gpu) == 123_456
    assert pynvml.nvmlDeviceGetEnforcedPowerLimit(gpu) == 654_321
    assert pynvml.nvmlDeviceGetPowerManagementLimit(gpu) == 654_321
    assert pynvml.nvmlDeviceGetTemperature(gpu, pynvml.NVML_TEMPERATURE_GPU) == 61
    assert pynvml.nvmlDeviceGetTemperatureV(gpu, pynvml.NVML_TEMPERATURE_GPU) == 61
    assert fields(gpu, [pynvml.NVML_FI_DEV_MEMORY_TEMP])[82].value.uiVal == 62
    slowdown = pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
    assert pynvml.nvmlDeviceGetTemperatureThreshold(gpu, slowdown) == 81
    assert pynvml.nvmlDeviceGetTemperatureThreshold(gpu, 0) == 91
    utilization = pynvml.nvmlDeviceGetUtilizationRates(gpu)
    assert (utilization.gpu, utilization.memory) == (41, 42)
    assert pynvml.nvmlDeviceGetCurrPcieLinkGeneration(gpu) == 3
    assert pynvml.nvmlDeviceGetCurrPcieLinkWidth(gpu) == 8
    assert pynvml.nvmlDeviceGetMaxPcieLinkGeneration(gpu) == 4
    assert pynvml.nvmlDeviceGetMaxPcieLinkWidth(gpu) == 16
    assert pynvml.nvmlDeviceGetPcieThroughput(gpu, pynvml.NVML_PCIE_UTIL_TX_BYTES) == 5000
    assert pynvml.nvmlDeviceGetPcieThroughput(gpu, pynvml.NVML_PCIE_UTIL_RX_BYTES) == 6000
    assert pynvml.nvmlDeviceGetFanSpeed(gpu) == 55
    assert pynvml.nvmlDeviceGetPerformanceState(gpu) == pynvml.NVML_PSTATE_2
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(gpu) == 0x24
    assert pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(gpu) == 0x24
    assert pynvml.nvmlDeviceGetSupportedClocksEventReasons(gpu) == 0xFF
    assert pynvml.nvmlDeviceGetSupportedEventTypes(gpu) == pynvml.nvmlEventTypeXidCriticalError
    corrected, uncorrected = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, 1
    for counter in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC):
        assert pynvml.nvmlDeviceGetTotalEccErrors(gpu, corrected, counter) == 7
        assert pynvml.nvmlDeviceGetTotalEccErrors(gpu, uncorrected, counter) == 1
    assert pynvml.nvmlDeviceGetRemappedRows(gpu) == (3, 2, 1, 0)
    gpus.stop()

    gpus.start(EVERY_KEY, at=15)
    gpu = handle(0)
    assert pynvml.nvmlDeviceGetClockInfo(gpu, pynvml.NVML_CLOCK_SM) == 1501
    assert pynvml.nvmlDeviceGetClockInfo(gpu, pynvml.NVML_CLOCK_GRAPHICS) == 1503
    assert pynvml.nvmlDeviceGetClockInfo(gpu, pynvml.NVML_CLOCK_MEM) == 1002
    assert pynvml.nvmlDeviceGetPowerUsage(gpu) == 223_456
    assert pynvml.nvmlDeviceGetTemperatureV(gpu, pynvml.NVML_TEMPERATURE_GPU) == 71
    assert pynvml.nvmlDeviceGetFanSpeed(gpu) == 65
    assert pynvml.nvmlDeviceGetMemoryInfo(gpu).free == 400
    assert pynvml.nvmlDeviceGetPerformanceState(gpu) == pynvml.NVML_PSTATE_0
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(gpu) == 0
    assert pynvml.nvmlDeviceGetTotalEccErrors(gpu, corrected, pynvml.NVML_AGGREGATE_ECC) == 9
    assert pynvml.nvmlDeviceGetRemappedRows(gpu) == (3, 2, 1, 1)
    assert pynvml.nvmlDeviceGetUtilizationRates(gpu).gpu == 99
    assert pynvml.nvmlDeviceGetPcieThroughput(gpu, pynvml.NVML_PCIE_UTIL_TX_BYTES) == 7000
    assert pynvml.nvmlDeviceGetMaxPcieLinkWidth(gpu) == 8


def test_a_bare_device_is_an_idle_h100_and_graphics_clock_follows_sm(gpus: FakeGpus) -> None:
    gpus.start("device 0\ndevice 1\nat 5 1 sm_clock_mhz 1700\n", at=10)
    assert pynvml.nvmlSystemGetDriverVersion() == "550.54.15"
    gpu = handle(0)
    assert pynvml.nvmlDeviceGetName(gpu) == "NVIDIA H100 80GB HBM3"
    assert pynvml.nvmlDeviceGetUUID(gpu) != pynvml.nvmlDeviceGetUUID(handle(1))
    assert pynvml.nvmlDeviceGetPciInfo(gpu).busId == "00000000:18:00.0"
    assert pynvml.nvmlDeviceGetClockInfo(gpu, pynvml.NVML_CLOCK_SM) == 345
    assert pynvml.nvmlDeviceGetPowerUsage(gpu) == 70_000
    assert pynvml.nvmlDeviceGetTotalEnergyConsumption(gpu) >= 700_000
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(gpu) == 1
    memory = pynvml.nvmlDeviceGetMemoryInfo(gpu, version=pynvml.nvmlMemory_v2)
    assert (memory.total, memory.reserved, memory.used) == (80 * GIB, 528 << 20, 0)
    assert pynvml.nvmlDeviceGetClockInfo(handle(1), pynvml.NVML_CLOCK_GRAPHICS) == 1700


def test_energy_is_the_exact_integral_of_power(gpus: FakeGpus) -> None:
    gpus.start(
        "device 0 energy_mj 1000\n"
        "at 0 0 power_mw 100000\nat 10 0 power_mw 300000\nat 20 0 power_mw 50000\n",
        at=30,
    )
    gpu = handle(0)

    def expected(t: float) -> float:
        return 1000 + 100_000 * 10 + 300_000 * 10 + 50_000 * (t - 20)

    before = gpus.now()
    energy = pynvml.nvmlDeviceGetTotalEnergyConsumption(gpu)
    field = fields(gpu, [pynvml.NVML_FI_DEV_ENERGY])[pynvml.NVML_FI_DEV_ENERGY].value.ullVal
    after = gpus.now()
    assert expected(before) - 1 <= energy <= field <= expected(after)


def test_power_usage_is_the_average_and_field_186_the_instant_power(gpus: FakeGpus) -> None:
    average, instant = pynvml.NVML_FI_DEV_POWER_AVERAGE, pynvml.NVML_FI_DEV_POWER_INSTANT
    gpus.start(
        "device 0 power_average_mw 300000\n"  # set anywhere: no longer follows power_mw
        "device 1\n"  # never set: the average follows power_mw
        "at 0 0 power_mw 100000\nat 10 0 power_mw 500000 power_average_mw 450000\n"
        "at 0 1 power_mw 200000\nat 10 1 power_mw 400000\n",
        at=15,
    )
    gpu0, gpu1 = handle(0), handle(1)
    assert pynvml.nvmlDeviceGetPowerUsage(gpu0) == 450_000
    values = fields(gpu0, [average, instant])
    assert (values[average].value.uiVal, values[instant].value.uiVal) == (450_000, 500_000)
    assert values[instant].valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    assert pynvml.nvmlDeviceGetPowerUsage(gpu1) == 400_000
    values = fields(gpu1, [average, instant])
    assert (values[average].value.uiVal, values[instant].value.uiVal) == (400_000, 400_000)
    # Energy integrates the instant power, never the average.
    energy = pynvml.nvmlDeviceGetTotalEnergyConsumption(gpu0)
    assert 100_000 * 10 + 500_000 * 5 <= energy <= 100_000 * 10 + 500_000 * 6
    gpus.stop()

    gpus.start("device 0 power_average_mw 300000\nat 10 0 power_mw 500000\n", at=5)
    gpu0 = handle(0)
    assert pynvml.nvmlDeviceGetPowerUsage(gpu0) == 300_000
    values = fields(gpu0, [average, instant])
    assert (values[average].value.uiVal, values[instant].value.uiVal) == (300_000, 70_000)


def test_time_scale_compresses_scenario_time(gpus: FakeGpus) -> None:
    """1000 scenario seconds a second: the step at 1000 s comes a real second after the start
    (room for a loaded machine's first call), not 1000 s after it."""
    scenario = gpus.write("set time_scale 1000\ndevice 0\nat 1000 0 power_mw 200000\n")
    gpus.start(scenario, time_scale=None)  # the file's `set time_scale 1000` rules
    assert pynvml.nvmlDeviceGetPowerUsage(handle(0)) == 70_000
    time.sleep(1.05)  # 1050 scenario seconds
    assert pynvml.nvmlDeviceGetPowerUsage(handle(0)) == 200_000
    energy = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle(0))
    assert energy >= 70_000 * 1000 + 200_000 * 50
    gpus.stop()

    gpus.start(scenario, time_scale=1)  # the environment overrides the file
    time.sleep(0.15)
    assert pynvml.nvmlDeviceGetPowerUsage(handle(0)) == 70_000


VIOLATIONS = """
device 0
at 0 0 reasons 0x0
at 10 0 reasons 0x4
at 20 0 reasons 0xC0
at 30 0 reasons 0x20
at 35 0 reasons 0x10
at 40 0 reasons 0x8
at 45 0 reasons 0x1
at 50 0 reasons 0x0
"""


def test_violation_counters_accumulate_while_their_reasons_are_set(gpus: FakeGpus) -> None:
    gpus.start(VIOLATIONS, at=100)
    gpu = handle(0)
    expected_seconds = {
        pynvml.NVML_FI_DEV_PERF_POLICY_POWER: 20,  # 0x4 and 0x80
        pynvml.NVML_FI_DEV_PERF_POLICY_THERMAL: 20,  # 0x40, 0x20 and 0x8
        pynvml.NVML_FI_DEV_PERF_POLICY_SYNC_BOOST: 5,
        pynvml.NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT: 0,
        pynvml.NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION: 5,  # 0x1, GPU idle
        pynvml.NVML_FI_DEV_PERF_POLICY_RELIABILITY: 0,
        pynvml.NVML_FI_DEV_PERF_POLICY_TOTAL_APP_CLOCKS: 0,
        pynvml.NVML_FI_DEV_PERF_POLICY_TOTAL_BASE_CLOCKS: 0,
        pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN: 5,
        pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN: 10,
        pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN: 10,
    }
    before_us = time.time() * 1e6
    values = fields(gpu, [*expected_seconds, pynvml.NVML_FI_DEV_MEMORY_TEMP, 9999])
    after_us = time.time() * 1e6
    for field_id, seconds in expected_seconds.items():
        value = values[field_id]
        assert value.nvmlReturn == pynvml.NVML_SUCCESS, field_id
        assert value.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, field_id
        assert value.value.ullVal == seconds * NS, field_id
        assert before_us - 1 <= value.timestamp <= after_us + 1
    memory_temp = values[pynvml.NVML_FI_DEV_MEMORY_TEMP]
    assert (memory_temp.valueType, memory_temp.value.uiVal) == (
        pynvml.NVML_VALUE_TYPE_UNSIGNED_INT,
        30,
    )
    assert values[9999].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED

    policies = {
        pynvml.NVML_PERF_POLICY_POWER: 20,
        pynvml.NVML_PERF_POLICY_THERMAL: 20,
        pynvml.NVML_PERF_POLICY_SYNC_BOOST: 5,
        pynvml.NVML_PERF_POLICY_BOARD_LIMIT: 0,
        pynvml.NVML_PERF_POLICY_LOW_UTILIZATION: 5,
        pynvml.NVML_PERF_POLICY_RELIABILITY: 0,
        pynvml.NVML_PERF_POLICY_TOTAL_APP_CLOCKS: 0,
        pynvml.NVML_PERF_POLICY_TOTAL_BASE_CLOCKS: 0,
    }
    for policy, seconds in policies.items():
        violation = pynvml.nvmlDeviceGetViolationStatus(gpu, policy)
        assert violation.violationTime == seconds * NS, policy
        assert abs(violation.referenceTime - time.time() * 1e6) < 5e6
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetViolationStatus(gpu, 7)


def test_acceptance_gpu1_thermal_slowdown_for_exactly_thirty_seconds(gpus: FakeGpus) -> None:
    thermal = pynvml.NVML_FI_DEV_PERF_POLICY_THERMAL
    hw_thermal = pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN
    sm = pynvml.NVML_CLOCK_SM
    # 60 s in 3 s: each check has 0.75 s or more of real time to be made in its window.
    gpus.start(SCENARIOS / "thermal_gpu1.scn", time_scale=20)
    gpu0, gpu1 = handle(0), handle(1)
    for gpu in (gpu0, gpu1):
        assert fields(gpu, [thermal])[thermal].value.ullVal == 0
        assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(gpu) == 0
        assert pynvml.nvmlDeviceGetClockInfo(gpu, sm) == 1410

    gpus.sleep_until(35)
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(gpu1) == (
        pynvml.nvmlClocksEventReasonHwThermalSlowdown
    )
    assert pynvml.nvmlDeviceGetClockInfo(gpu1, sm) == 1100
    assert pynvml.nvmlDeviceGetTemperatureV(gpu1, pynvml.NVML_TEMPERATURE_GPU) == 88
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(gpu0) == 0
    assert pynvml.nvmlDeviceGetClockInfo(gpu0, sm) == 1410

    gpus.sleep_until(55)
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(gpu1) == 0
    assert pynvml.nvmlDeviceGetClockInfo(gpu1, sm) == 1410
    counters = fields(gpu1, [thermal, hw_thermal])
    assert counters[thermal].value.ullVal == 30 * NS
    assert counters[hw_thermal].value.ullVal == 30 * NS
    status = pynvml.nvmlDeviceGetViolationStatus(gpu1, pynvml.NVML_PERF_POLICY_THERMAL)
    assert status.violationTime == 30 * NS
    assert fields(gpu0, [thermal])[thermal].value.ullVal == 0
    assert (
        pynvml.nvmlDeviceGetViolationStatus(gpu0, pynvml.NVML_PERF_POLICY_THERMAL).violationTime
        == 0
    )


@dataclass
class LostTarget:
    """What every_device_call needs of one plain GPU and one GPU in MIG mode."""

    gpu: Any
    mig_gpu: Any  # in MIG mode, GPU instance 1 is its MIG device 0
    mig: Any
    sample1: Any  # two samples taken on gpu
    sample2: Any
    mig_sample: Any  # an allocated sample for nvmlGpmMigSampleGet


def every_device_call(target: LostTarget, events: Any) -> dict[str, Callable[[], object]]:
    """One call of each exported function that takes a device, keyed by the symbol it reaches."""
    gpu, mig_gpu, mig = target.gpu, target.mig_gpu, target.mig
    sample1, sample2 = target.sample1, target.sample2
    return {
        "nvmlDeviceGetIndex": lambda: pynvml.nvmlDeviceGetIndex(gpu),
        "nvmlDeviceGetUUID": lambda: pynvml.nvmlDeviceGetUUID(gpu),
        "nvmlDeviceGetName": lambda: pynvml.nvmlDeviceGetName(gpu),
        "nvmlDeviceGetSerial": lambda: pynvml.nvmlDeviceGetSerial(gpu),
        "nvmlDeviceGetPciInfo_v3": lambda: pynvml.nvmlDeviceGetPciInfo(gpu),
        "nvmlDeviceGetVbiosVersion": lambda: pynvml.nvmlDeviceGetVbiosVersion(gpu),
        "nvmlDeviceGetBoardPartNumber": lambda: pynvml.nvmlDeviceGetBoardPartNumber(gpu),
        "nvmlDeviceGetCudaComputeCapability": (
            lambda: pynvml.nvmlDeviceGetCudaComputeCapability(gpu)
        ),
        "nvmlDeviceGetArchitecture": lambda: pynvml.nvmlDeviceGetArchitecture(gpu),
        "nvmlDeviceGetClockInfo": lambda: pynvml.nvmlDeviceGetClockInfo(gpu, 1),
        "nvmlDeviceGetMaxClockInfo": lambda: pynvml.nvmlDeviceGetMaxClockInfo(gpu, 1),
        "nvmlDeviceGetPowerUsage": lambda: pynvml.nvmlDeviceGetPowerUsage(gpu),
        "nvmlDeviceGetEnforcedPowerLimit": lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(gpu),
        "nvmlDeviceGetPowerManagementLimit": (
            lambda: pynvml.nvmlDeviceGetPowerManagementLimit(gpu)
        ),
        "nvmlDeviceGetTotalEnergyConsumption": (
            lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(gpu)
        ),
        "nvmlDeviceGetTemperature": lambda: pynvml.nvmlDeviceGetTemperature(gpu, 0),
        "nvmlDeviceGetTemperatureV": lambda: pynvml.nvmlDeviceGetTemperatureV(gpu, 0),
        "nvmlDeviceGetTemperatureThreshold": (
            lambda: pynvml.nvmlDeviceGetTemperatureThreshold(gpu, 1)
        ),
        "nvmlDeviceGetUtilizationRates": lambda: pynvml.nvmlDeviceGetUtilizationRates(gpu),
        "nvmlDeviceGetMemoryInfo": lambda: pynvml.nvmlDeviceGetMemoryInfo(gpu),
        "nvmlDeviceGetMemoryInfo_v2": (
            lambda: pynvml.nvmlDeviceGetMemoryInfo(gpu, version=pynvml.nvmlMemory_v2)
        ),
        "nvmlDeviceGetCurrPcieLinkGeneration": (
            lambda: pynvml.nvmlDeviceGetCurrPcieLinkGeneration(gpu)
        ),
        "nvmlDeviceGetMaxPcieLinkGeneration": (
            lambda: pynvml.nvmlDeviceGetMaxPcieLinkGeneration(gpu)
        ),
        "nvmlDeviceGetCurrPcieLinkWidth": lambda: pynvml.nvmlDeviceGetCurrPcieLinkWidth(gpu),
        "nvmlDeviceGetMaxPcieLinkWidth": lambda: pynvml.nvmlDeviceGetMaxPcieLinkWidth(gpu),
        "nvmlDeviceGetPcieThroughput": lambda: pynvml.nvmlDeviceGetPcieThroughput(gpu, 0),
        "nvmlDeviceGetFanSpeed": lambda: pynvml.nvmlDeviceGetFanSpeed(gpu),
        "nvmlDeviceGetPerformanceState": lambda: pynvml.nvmlDeviceGetPerformanceState(gpu),
        "nvmlDeviceGetCurrentClocksEventReasons": (
            lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(gpu)
        ),
        "nvmlDeviceGetCurrentClocksThrottleReasons": (
            lambda: pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(gpu)
        ),
        "nvmlDeviceGetSupportedClocksEventReasons": (
            lambda: pynvml.nvmlDeviceGetSupportedClocksEventReasons(gpu)
        ),
        "nvmlDeviceGetSupportedClocksThrottleReasons": (
            lambda: pynvml.nvmlDeviceGetSupportedClocksThrottleReasons(gpu)
        ),
        "nvmlDeviceGetFieldValues": lambda: pynvml.nvmlDeviceGetFieldValues(gpu, [75]),
        "nvmlDeviceGetViolationStatus": lambda: pynvml.nvmlDeviceGetViolationStatus(gpu, 1),
        "nvmlDeviceGetTotalEccErrors": lambda: pynvml.nvmlDeviceGetTotalEccErrors(gpu, 0, 1),
        "nvmlDeviceGetRemappedRows": lambda: pynvml.nvmlDeviceGetRemappedRows(gpu),
        "nvmlDeviceGetComputeRunningProcesses_v3": (
            lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(gpu)
        ),
        "nvmlDeviceGetSupportedEventTypes": lambda: pynvml.nvmlDeviceGetSupportedEventTypes(gpu),
        "nvmlDeviceRegisterEvents": (
            lambda: pynvml.nvmlDeviceRegisterEvents(
                gpu, pynvml.nvmlEventTypeXidCriticalError, events
            )
        ),
        "nvmlGpmQueryDeviceSupport": lambda: pynvml.nvmlGpmQueryDeviceSupport(gpu),
        "nvmlGpmSampleGet": lambda: pynvml.nvmlGpmSampleGet(gpu, sample2),
        "nvmlGpmMetricsGet": lambda: gpm_metrics(
            sample1, sample2, [pynvml.NVML_GPM_METRIC_SM_UTIL]
        ),
        "nvmlDeviceGetMigMode": lambda: pynvml.nvmlDeviceGetMigMode(mig_gpu),
        "nvmlDeviceGetMaxMigDeviceCount": lambda: pynvml.nvmlDeviceGetMaxMigDeviceCount(mig_gpu),
        "nvmlDeviceGetMigDeviceHandleByIndex": (
            lambda: pynvml.nvmlDeviceGetMigDeviceHandleByIndex(mig_gpu, 0)
        ),
        "nvmlDeviceIsMigDeviceHandle": lambda: pynvml.nvmlDeviceIsMigDeviceHandle(mig),
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle": (
            lambda: pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
        ),
        "nvmlDeviceGetGpuInstanceId": lambda: pynvml.nvmlDeviceGetGpuInstanceId(mig),
        "nvmlDeviceGetComputeInstanceId": lambda: pynvml.nvmlDeviceGetComputeInstanceId(mig),
        "nvmlGpmMigSampleGet": lambda: pynvml.nvmlGpmMigSampleGet(mig_gpu, 1, target.mig_sample),
        "nvmlDeviceGetCpuAffinity": lambda: pynvml.nvmlDeviceGetCpuAffinity(gpu, 1),
        "nvmlDeviceGetCpuAffinityWithinScope": (
            lambda: pynvml.nvmlDeviceGetCpuAffinityWithinScope(gpu, 1, 0)
        ),
        "nvmlDeviceGetNumaNodeId": lambda: pynvml.nvmlDeviceGetNumaNodeId(gpu),
    }


def lost_target(gpu: Any, mig_gpu: Any) -> LostTarget:
    target = LostTarget(
        gpu,
        mig_gpu,
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(mig_gpu, 0),
        pynvml.nvmlGpmSampleAlloc(),
        pynvml.nvmlGpmSampleAlloc(),
        pynvml.nvmlGpmSampleAlloc(),
    )
    pynvml.nvmlGpmSampleGet(gpu, target.sample1)
    pynvml.nvmlGpmSampleGet(gpu, target.sample2)
    return target


def free_samples(target: LostTarget) -> None:
    for sample in (target.sample1, target.sample2, target.mig_sample):
        pynvml.nvmlGpmSampleFree(sample)


# Calls on a MIG device handle that answer while its parent answers.
MIG_HANDLE_CALLS: list[Callable[[Any], object]] = [
    pynvml.nvmlDeviceGetUUID,
    pynvml.nvmlDeviceGetName,
    pynvml.nvmlDeviceGetMemoryInfo,
    pynvml.nvmlDeviceGetComputeRunningProcesses,
    pynvml.nvmlDeviceGetGpuInstanceId,
    pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle,
    lambda mig: pynvml.nvmlDeviceGetCpuAffinity(mig, 1),
]


def test_a_lost_gpu_fails_every_device_call_then_recovers(gpus: FakeGpus) -> None:
    gpus.start(
        "device 0 cpu_affinity 0-7 numa_node 0\ndevice 1 cpu_affinity 8-15 numa_node 1\n"
        "device 2 mig_mode 1 cpu_affinity 16-23\ndevice 3 mig_mode 1 cpu_affinity 24-31\n"
        "mig 2 1 0 MIG-00000000-0000-4000-8000-000000000002 42949672960\n"
        "mig 3 1 0 MIG-00000000-0000-4000-8000-000000000003 42949672960\n"
        "fault 0 lost - 10 14\nfault 2 lost - 10 14\n",
        at=8,
        time_scale=2,  # a real second before the window, 1.5 s in it after sleep_until(11)
    )
    lost = lost_target(handle(0), handle(2))
    uuid = pynvml.nvmlDeviceGetUUID(lost.gpu)
    mig_uuid = pynvml.nvmlDeviceGetUUID(lost.mig)
    events = pynvml.nvmlEventSetCreate()
    calls = every_device_call(lost, events)
    by_index_or_uuid = {"nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByUUID"}
    assert set(calls) | by_index_or_uuid == set(exported_functions()) - SYSTEM_FUNCTIONS
    for call in calls.values():
        call()
    for mig_call in MIG_HANDLE_CALLS:
        mig_call(lost.mig)
    healthy = lost_target(handle(1), handle(3))
    healthy_calls = every_device_call(healthy, events)

    gpus.sleep_until(11)
    answered = []
    for name, call in calls.items():
        try:
            call()
        except pynvml.NVMLError_GpuIsLost:
            continue
        answered.append(name)
    assert answered == []
    for mig_call in MIG_HANDLE_CALLS:  # a lost parent takes its MIG devices with it
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            mig_call(lost.mig)
    with pytest.raises(pynvml.NVMLError_GpuIsLost) as lost_error:
        pynvml.nvmlDeviceGetHandleByIndex(0)
    assert str(lost_error.value) == "GPU is lost"
    for lost_uuid in (uuid, mig_uuid):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetHandleByUUID(lost_uuid)
    assert pynvml.nvmlDeviceGetCount() == 4
    assert pynvml.nvmlDeviceGetIndex(handle(1)) == 1
    for call in healthy_calls.values():
        call()
    for mig_call in MIG_HANDLE_CALLS:
        mig_call(healthy.mig)
    assert gpus.now() < 14, "the machine was too slow to check inside the window"

    gpus.sleep_until(14.5)
    for call in calls.values():
        call()
    for mig_call in MIG_HANDLE_CALLS:
        mig_call(lost.mig)
    assert pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(uuid)) == 0
    assert pynvml.nvmlDeviceGetGpuInstanceId(pynvml.nvmlDeviceGetHandleByUUID(mig_uuid)) == 1
    pynvml.nvmlEventSetFree(events)
    free_samples(lost)
    free_samples(healthy)


def test_function_and_field_faults_in_their_windows(gpus: FakeGpus) -> None:
    scenario = gpus.write(
        "device 0\ndevice 1\n"
        "fault 0 unsupported nvmlDeviceGetPowerUsage - -\n"
        "fault 0 no_permission nvmlDeviceGetTotalEnergyConsumption - -\n"
        "fault 0 timeout nvmlDeviceGetClockInfo 10 20\n"
        "fault 0 unknown nvmlDeviceGetTemperatureV 10 20\n"
        "fault 0 unsupported field:82 - -\n"
        "fault 0 no_permission field:75 10 20\n"
    )
    gpus.start(scenario, at=15)
    gpu = handle(0)
    expected: dict[type[Exception], Callable[[], object]] = {
        pynvml.NVMLError_NotSupported: lambda: pynvml.nvmlDeviceGetPowerUsage(gpu),
        pynvml.NVMLError_NoPermission: lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(gpu),
        pynvml.NVMLError_Timeout: lambda: pynvml.nvmlDeviceGetClockInfo(gpu, 1),
        pynvml.NVMLError_Unknown: lambda: pynvml.nvmlDeviceGetTemperatureV(gpu, 0),
    }
    for error, call in expected.items():
        with pytest.raises(error):
            call()
    values = fields(gpu, [82, 75, 74])
    assert [values[i].nvmlReturn for i in (82, 75, 74)] == [
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_NO_PERMISSION,
        pynvml.NVML_SUCCESS,
    ]
    other = handle(1)
    assert pynvml.nvmlDeviceGetPowerUsage(other) == 70_000
    assert pynvml.nvmlDeviceGetClockInfo(other, 1) == 345
    assert all(value.nvmlReturn == 0 for value in pynvml.nvmlDeviceGetFieldValues(other, [82, 75]))
    gpus.stop()

    gpus.start(scenario, at=25)
    gpu = handle(0)
    assert pynvml.nvmlDeviceGetClockInfo(gpu, 1) == 345
    assert pynvml.nvmlDeviceGetTemperatureV(gpu, 0) == 32
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetPowerUsage(gpu)
    values = fields(gpu, [82, 75])
    assert (values[82].nvmlReturn, values[75].nvmlReturn) == (pynvml.NVML_ERROR_NOT_SUPPORTED, 0)


def test_error_strings_are_nvmls(gpus: FakeGpus) -> None:
    gpus.start("device 0\n")
    assert pynvml.nvmlErrorString(pynvml.NVML_SUCCESS) == "Success"
    for code, text in pynvml.NVMLError._errcode_to_string.items():
        assert pynvml.nvmlErrorString(code) == text, code
    for code in (
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_GPU_IS_LOST,
        pynvml.NVML_ERROR_TIMEOUT,
        pynvml.NVML_ERROR_NO_PERMISSION,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        pynvml.NVML_ERROR_UNKNOWN,
    ):
        assert pynvml.nvmlErrorString(code) == str(pynvml.NVMLError(code))
    # Codes pynvml has no text for are formatted by calling nvmlErrorString.
    mismatch = pynvml.NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    assert str(mismatch) == "Argument version mismatch"


def test_versioned_structs_are_checked(gpus: FakeGpus) -> None:
    gpus.start("device 0\n")
    gpu = handle(0)
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        pynvml.nvmlDeviceGetMemoryInfo(gpu, version=0x01000028)
    temperature = pynvml.c_nvmlTemperature_v1_t()
    temperature.version = pynvml.nvmlTemperature_v1 + (1 << 24)
    result = raw("nvmlDeviceGetTemperatureV")(gpu, ctypes.byref(temperature))
    assert result == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    support = pynvml.c_nvmlGpmSupport_t()
    support.version = 2
    result = raw("nvmlGpmQueryDeviceSupport")(gpu, ctypes.byref(support))
    assert result == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    sample = pynvml.nvmlGpmSampleAlloc()
    pynvml.nvmlGpmSampleGet(gpu, sample)
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = 2
    request.sample1 = request.sample2 = sample
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        pynvml.nvmlGpmMetricsGet(request)
    pynvml.nvmlGpmSampleFree(sample)


def test_bad_arguments_and_small_buffers(gpus: FakeGpus) -> None:
    gpus.start("device 0\n")
    gpu = handle(0)
    invalid: list[Callable[[], object]] = [
        lambda: pynvml.nvmlDeviceGetHandleByIndex(1),
        lambda: pynvml.nvmlDeviceGetTemperature(gpu, 1),
        lambda: pynvml.nvmlDeviceGetClockInfo(gpu, 7),
        lambda: pynvml.nvmlDeviceGetTemperatureThreshold(gpu, 9),
        lambda: pynvml.nvmlDeviceGetTotalEccErrors(gpu, 2, 0),
        lambda: pynvml.nvmlDeviceGetPcieThroughput(gpu, 2),
        lambda: pynvml.nvmlEventSetFree(None),
    ]
    for call in invalid:
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            call()
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByUUID("GPU-not-here")
    small = ctypes.create_string_buffer(8)
    assert raw("nvmlDeviceGetName")(gpu, small, ctypes.c_uint(8)) == (
        pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    )
    assert raw("nvmlSystemGetDriverVersion")(small, ctypes.c_uint(8)) == (
        pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    )
    assert raw("nvmlDeviceGetPowerUsage")(gpu, None) == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_init_is_refcounted_and_rereads_the_scenario_after_a_full_shutdown(
    gpus: FakeGpus,
) -> None:
    scenario = gpus.start('device 0 name "First"\n')
    old_handle = handle(0)
    scenario.write_text('device 0 name "Second"\ndevice 1\n')
    gpus.init()  # nested: keeps the scenario it has
    assert pynvml.nvmlDeviceGetCount() == 1
    gpus.shutdown()
    assert pynvml.nvmlDeviceGetName(handle(0)) == "First"
    gpus.shutdown()
    for call in (
        pynvml.nvmlDeviceGetCount,
        pynvml.nvmlSystemGetDriverVersion,
        lambda: pynvml.nvmlDeviceGetName(old_handle),
        pynvml.nvmlShutdown,
    ):
        with pytest.raises(pynvml.NVMLError_Uninitialized):
            call()
    gpus.init()
    assert pynvml.nvmlDeviceGetCount() == 2
    assert pynvml.nvmlDeviceGetName(handle(0)) == "Second"


def test_compute_processes_follow_the_two_call_protocol(gpus: FakeGpus) -> None:
    scenario = gpus.write(
        "device 0\ndevice 1\nprocess 0 4242 1073741824 5 40\nprocess 0 4343 2147483648 10 -\n"
    )
    running: dict[int, list[tuple[int, int, int, int]]] = {}
    for at in (2, 20, 50):
        gpus.start(scenario, at=at)
        running[at] = [
            (p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle(0))
        ]
        assert pynvml.nvmlDeviceGetComputeRunningProcesses(handle(1)) == []
        gpus.stop()
    no_mig = 0xFFFFFFFF
    assert running == {
        2: [],
        20: [(4242, GIB, no_mig, no_mig), (4343, 2 * GIB, no_mig, no_mig)],
        50: [(4343, 2 * GIB, no_mig, no_mig)],
    }


MIG_UUID_1 = "MIG-11111111-1111-4111-8111-111111111111"
MIG_UUID_2 = "MIG-22222222-2222-4222-8222-222222222222"
MIG_GPUS = f"""
device 0 mig_mode 1
mig 0 1 0 {MIG_UUID_1} 42949672960
mig 0 2 0 {MIG_UUID_2} 42949672960
device 1                          # MIG-capable, MIG mode off
device 2 max_mig_devices 0        # no MIG support at all
process 0 100 1073741824 - -      # on the parent itself
process 0:0 200 2147483648 - -
process 0:1 300 3221225472 5 -
process 0:1 301 1073741824 - 5
fault 0:1 no_permission nvmlDeviceGetComputeRunningProcesses_v3 20 30
"""


def processes(device: Any) -> list[tuple[int, int, int, int]]:
    return [
        (p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(device)
    ]


def test_mig_devices_of_a_parent_in_mig_mode(gpus: FakeGpus) -> None:
    scenario = gpus.write(MIG_GPUS)
    gpus.start(scenario, at=10)
    assert pynvml.nvmlDeviceGetCount() == 3  # parents only
    gpu, plain, no_mig = handle(0), handle(1), handle(2)
    assert pynvml.nvmlDeviceGetMigMode(gpu) == [1, 1]
    assert pynvml.nvmlDeviceGetMigMode(plain) == [0, 0]
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu) == 7
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(plain) == 0
    for call in (
        pynvml.nvmlDeviceGetMigMode,
        pynvml.nvmlDeviceGetMaxMigDeviceCount,
        lambda device: pynvml.nvmlDeviceGetMigDeviceHandleByIndex(device, 0),
    ):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call(no_mig)
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 2)  # a free slot
    for parent, index in ((gpu, 7), (plain, 0)):
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, index)

    first = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
    second = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 1)
    assert pynvml.nvmlDeviceIsMigDeviceHandle(first).value == 1
    assert pynvml.nvmlDeviceIsMigDeviceHandle(gpu).value == 0
    parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(second)
    assert ctypes.cast(parent, ctypes.c_void_p).value == ctypes.cast(gpu, ctypes.c_void_p).value
    assert [pynvml.nvmlDeviceGetGpuInstanceId(m) for m in (first, second)] == [1, 2]
    assert [pynvml.nvmlDeviceGetComputeInstanceId(m) for m in (first, second)] == [0, 0]
    assert [pynvml.nvmlDeviceGetUUID(m) for m in (first, second)] == [MIG_UUID_1, MIG_UUID_2]
    by_uuid = pynvml.nvmlDeviceGetHandleByUUID(MIG_UUID_2)
    assert pynvml.nvmlDeviceGetGpuInstanceId(by_uuid) == 2
    assert pynvml.nvmlDeviceGetName(second) == "NVIDIA H100 80GB HBM3 MIG"
    memory = pynvml.nvmlDeviceGetMemoryInfo(second, version=pynvml.nvmlMemory_v2)
    assert (memory.total, memory.reserved, memory.used, memory.free) == (
        40 * GIB,
        0,
        3 * GIB,
        37 * GIB,
    )
    memory_v1 = pynvml.nvmlDeviceGetMemoryInfo(first)
    assert (memory_v1.total, memory_v1.used, memory_v1.free) == (40 * GIB, 2 * GIB, 38 * GIB)
    assert pynvml.nvmlDeviceGetMemoryInfo(gpu).total == 80 * GIB  # the parent's own keys

    no_mig_ids = 0xFFFFFFFF
    assert processes(first) == [(200, 2 * GIB, 1, 0)]
    assert processes(second) == [(300, 3 * GIB, 2, 0)]
    assert processes(gpu) == [
        (100, GIB, no_mig_ids, no_mig_ids),
        (200, 2 * GIB, 1, 0),
        (300, 3 * GIB, 2, 0),
    ]
    assert processes(plain) == []

    # NVML has no utilization in MIG mode; MIG handles answer only what concerns an instance.
    for device in (gpu, first):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetUtilizationRates(device)
    assert pynvml.nvmlDeviceGetUtilizationRates(plain).gpu == 0
    for call in (
        pynvml.nvmlDeviceGetPowerUsage,
        pynvml.nvmlDeviceGetSerial,
        lambda device: pynvml.nvmlDeviceGetFieldValues(device, [186]),
        pynvml.nvmlGpmQueryDeviceSupport,
    ):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call(first)
    parent_only: list[Callable[[Any], object]] = [
        pynvml.nvmlDeviceGetIndex,
        pynvml.nvmlDeviceGetMigMode,
        pynvml.nvmlDeviceGetMaxMigDeviceCount,
        lambda device: pynvml.nvmlDeviceGetMigDeviceHandleByIndex(device, 0),
    ]
    mig_only: list[Callable[[Any], object]] = [
        pynvml.nvmlDeviceGetGpuInstanceId,
        pynvml.nvmlDeviceGetComputeInstanceId,
        pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle,
    ]
    for call, wrong in [(c, first) for c in parent_only] + [(c, gpu) for c in mig_only]:
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            call(wrong)
    gpus.stop()

    gpus.start(scenario, at=2)
    assert processes(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle(0), 1)) == [(301, GIB, 2, 0)]
    gpus.stop()

    gpus.start(scenario, at=25)  # `fault 0:1 ...` refuses MIG device 1 only
    gpu = handle(0)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        pynvml.nvmlDeviceGetComputeRunningProcesses(
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 1)
        )
    assert processes(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)) == [(200, 2 * GIB, 1, 0)]
    assert [p[0] for p in processes(gpu)] == [100, 200, 300]


def test_a_parent_fault_refuses_the_parent_call_only(gpus: FakeGpus) -> None:
    gpus.start(MIG_GPUS + "fault 0 no_permission nvmlDeviceGetComputeRunningProcesses_v3 - -\n")
    gpu = handle(0)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        pynvml.nvmlDeviceGetComputeRunningProcesses(gpu)
    assert processes(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)) == [(200, 2 * GIB, 1, 0)]


def test_gpm_samples_of_a_gpu_instance(gpus: FakeGpus) -> None:
    gpus.start(
        MIG_GPUS + "at 10 0 gpm_sm_util_pct 42.5\nfault 0 no_permission nvmlGpmMigSampleGet 30 -\n",
        at=9,
        time_scale=10,
    )
    gpu, plain = handle(0), handle(1)
    first, second, whole, other = (pynvml.nvmlGpmSampleAlloc() for _ in range(4))
    pynvml.nvmlGpmMigSampleGet(gpu, 2, first)
    gpus.sleep_until(11)
    pynvml.nvmlGpmMigSampleGet(gpu, 2, second)
    result = gpm_metrics(first, second, [pynvml.NVML_GPM_METRIC_SM_UTIL])
    assert (result.metrics[0].nvmlReturn, result.metrics[0].value) == (0, 42.5)
    pynvml.nvmlGpmSampleGet(gpu, whole)
    pynvml.nvmlGpmMigSampleGet(gpu, 1, other)
    for mixed in ((first, whole), (first, other)):  # another instance, or the whole GPU
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            gpm_metrics(*mixed, [pynvml.NVML_GPM_METRIC_SM_UTIL])
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlGpmMigSampleGet(gpu, 9, other)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlGpmMigSampleGet(plain, 1, other)  # not in MIG mode
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlGpmMigSampleGet(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0), 1, other)
    gpus.sleep_until(31)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        pynvml.nvmlGpmMigSampleGet(gpu, 2, second)
    for sample in (first, second, whole, other):
        pynvml.nvmlGpmSampleFree(sample)


def test_cpu_affinity_and_numa_node(gpus: FakeGpus) -> None:
    gpus.start(
        "device 0 cpu_affinity 0-3,8,10-11,64,130 numa_node 1\n"
        "device 1\n"  # neither key: NOT_SUPPORTED, as a driver that cannot tell
        "device 2 mig_mode 1 cpu_affinity 5 numa_node 0\n"
        "mig 2 1 0 MIG-33333333-3333-4333-8333-333333333333 1073741824\n"
        "fault 2:0 unknown nvmlDeviceGetNumaNodeId - -\n"
    )
    gpu, plain = handle(0), handle(1)
    expected = [0xF | 1 << 8 | 0b11 << 10, 1 << 0, 1 << 2, 0]
    assert list(pynvml.nvmlDeviceGetCpuAffinity(gpu, 4)) == expected
    assert list(pynvml.nvmlDeviceGetCpuAffinity(gpu, 1)) == expected[:1]  # CPUs 64+ dropped
    for scope in (pynvml.NVML_AFFINITY_SCOPE_NODE, pynvml.NVML_AFFINITY_SCOPE_SOCKET):
        assert list(pynvml.nvmlDeviceGetCpuAffinityWithinScope(gpu, 3, scope)) == expected[:3]
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetCpuAffinityWithinScope(gpu, 3, 2)
    cpu_set = (ctypes.c_ulonglong * 1)()
    assert raw("nvmlDeviceGetCpuAffinity")(gpu, 0, ctypes.byref(cpu_set)) == (
        pynvml.NVML_ERROR_INVALID_ARGUMENT
    )
    assert pynvml.nvmlDeviceGetNumaNodeId(gpu) == 1
    unset: list[Callable[[], object]] = [
        lambda: pynvml.nvmlDeviceGetCpuAffinity(plain, 1),
        lambda: pynvml.nvmlDeviceGetCpuAffinityWithinScope(plain, 1, 1),
        lambda: pynvml.nvmlDeviceGetNumaNodeId(plain),
    ]
    for call in unset:
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()

    mig_gpu = handle(2)
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(mig_gpu, 0)
    assert list(pynvml.nvmlDeviceGetCpuAffinity(mig, 1)) == [1 << 5]  # the parent's
    assert pynvml.nvmlDeviceGetNumaNodeId(mig_gpu) == 0
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlDeviceGetNumaNodeId(mig)


def test_the_shipped_mig_node_scenario(gpus: FakeGpus) -> None:
    gpus.start(SCENARIOS / "mig_node.scn", at=5)
    assert pynvml.nvmlDeviceGetCount() == 2
    gpu0, gpu1 = handle(0), handle(1)
    assert pynvml.nvmlDeviceGetMigMode(gpu0) == [1, 1]
    assert pynvml.nvmlDeviceGetMigMode(gpu1) == [0, 0]
    migs = [pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu0, i) for i in (0, 1)]
    assert [pynvml.nvmlDeviceGetUUID(m) for m in migs] == [MIG_UUID_1, MIG_UUID_2]
    assert [pynvml.nvmlDeviceGetGpuInstanceId(m) for m in migs] == [1, 2]
    assert [pynvml.nvmlDeviceGetMemoryInfo(m).total for m in migs] == [40 * GIB, 40 * GIB]
    assert [processes(m) for m in migs] == [[(5101, 20 * GIB, 1, 0)], [(5202, 30 * GIB, 2, 0)]]
    assert [p[0] for p in processes(gpu0)] == [5101, 5202]
    assert processes(gpu1) == [(5303, 64 * GIB, 0xFFFFFFFF, 0xFFFFFFFF)]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetUtilizationRates(gpu0)
    assert pynvml.nvmlDeviceGetUtilizationRates(gpu1).gpu == 98

    average, instant = pynvml.NVML_FI_DEV_POWER_AVERAGE, pynvml.NVML_FI_DEV_POWER_INSTANT
    power = []
    for gpu in (gpu0, gpu1):
        values = fields(gpu, [average, instant])
        assert pynvml.nvmlDeviceGetPowerUsage(gpu) == values[average].value.uiVal
        power.append((values[average].value.uiVal, values[instant].value.uiVal))
    assert power == [(338_000, 352_000), (497_000, 512_000)]

    assert [list(pynvml.nvmlDeviceGetCpuAffinity(g, 1)) for g in (gpu0, gpu1)] == [[1], [2]]
    assert list(pynvml.nvmlDeviceGetCpuAffinity(migs[1], 1)) == [1]
    assert [pynvml.nvmlDeviceGetNumaNodeId(g) for g in (gpu0, gpu1)] == [0, 1]


def test_xid_events_are_delivered_once_in_time_order(gpus: FakeGpus) -> None:
    gpus.start(
        "device 0\ndevice 1\n"
        "xid 1 1 13\n"  # before anyone listens: lost, as on real hardware
        "xid 1 13 48\nxid 1 10 79\nxid 0 11 31\n",
        at=3,
        time_scale=5,  # 1.4 real seconds to register before the first XID that counts
    )
    xid = pynvml.nvmlEventTypeXidCriticalError
    only_gpu1 = pynvml.nvmlEventSetCreate()
    both = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(handle(1), xid, only_gpu1)
    pynvml.nvmlDeviceRegisterEvents(handle(0), xid, both)
    pynvml.nvmlDeviceRegisterEvents(handle(1), xid, both)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceRegisterEvents(handle(0), pynvml.nvmlEventTypeGpuRecoveryAction, both)

    delivered: list[tuple[int, int]] = []
    for _ in range(2):
        event = pynvml.nvmlEventSetWait(only_gpu1, 2000)
        delivered.append((pynvml.nvmlDeviceGetIndex(event.device), event.eventData))
        assert event.eventType == xid
        assert gpus.now() >= {79: 10, 48: 13}[event.eventData]
    assert delivered == [(1, 79), (1, 48)]
    started = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout) as timeout:
        pynvml.nvmlEventSetWait(only_gpu1, 100)
    assert time.monotonic() - started >= 0.095
    assert str(timeout.value) == "Timeout"

    order: list[tuple[int, int]] = []
    for _ in range(3):
        event = pynvml.nvmlEventSetWait(both, 0)
        order.append((pynvml.nvmlDeviceGetIndex(event.device), event.eventData))
    assert order == [(1, 79), (0, 31), (1, 48)]
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait(both, 0)
    pynvml.nvmlEventSetFree(only_gpu1)
    pynvml.nvmlEventSetFree(both)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlEventSetWait(both, 0)


def test_waiting_for_events_does_not_block_polling_threads(gpus: FakeGpus) -> None:
    """Calls from other threads are answered while one waits for events (4 s, no event comes):
    they end while it still waits, however slowly a loaded machine runs them."""
    gpus.start("device 0\ndevice 1\nxid 0 1000 79\n", time_scale=1)
    events = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(handle(0), pynvml.nvmlEventTypeXidCriticalError, events)
    outcomes: list[str] = []

    def wait() -> None:
        try:
            pynvml.nvmlEventSetWait(events, 4000)
        except pynvml.NVMLError_Timeout:
            outcomes.append("timeout")

    def poll(index: int) -> None:
        gpu = handle(index)
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            pynvml.nvmlDeviceGetPowerUsage(gpu)
            pynvml.nvmlDeviceGetFieldValues(gpu, [74, 75, 82])
            pynvml.nvmlDeviceGetTotalEnergyConsumption(gpu)
        outcomes.append("polled")

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)  # into its wait
    for _ in range(100):
        pynvml.nvmlDeviceGetPowerUsage(handle(1))
    assert waiter.is_alive(), "the waiting thread held the lock until its wait ended"
    pollers = [threading.Thread(target=poll, args=(i % 2,)) for i in range(4)]
    for poller in pollers:
        poller.start()
    for poller in pollers:
        poller.join()
    assert waiter.is_alive(), "the pollers waited for the waiting thread"
    waiter.join()
    assert outcomes == ["polled"] * 4 + ["timeout"]
    pynvml.nvmlEventSetFree(events)


def test_gpm_metrics_come_from_the_second_sample(gpus: FakeGpus) -> None:
    gpus.start(
        "device 0\ndevice 1 gpm_supported 0\n"
        "at 0 0 gpm_sm_util_pct 10 gpm_sm_occupancy_pct 11 gpm_tensor_util_pct 12\n"
        "at 0 0 gpm_dram_bw_util_pct 13 gpm_graphics_util_pct 14\n"
        "at 10 0 gpm_sm_util_pct 90.5 gpm_sm_occupancy_pct 45 gpm_tensor_util_pct 61.25\n"
        "at 10 0 gpm_dram_bw_util_pct 55 gpm_graphics_util_pct 99\n",
        at=9,
        time_scale=10,
    )
    gpu = handle(0)
    assert pynvml.nvmlGpmQueryDeviceSupport(gpu).isSupportedDevice == 1
    assert pynvml.nvmlGpmQueryDeviceSupport(handle(1)).isSupportedDevice == 0
    first, second = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
    pynvml.nvmlGpmSampleGet(gpu, first)
    gpus.sleep_until(11)
    pynvml.nvmlGpmSampleGet(gpu, second)
    ids = [
        pynvml.NVML_GPM_METRIC_SM_UTIL,
        pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
        pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
        pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
        pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL,
        pynvml.NVML_GPM_METRIC_INTEGER_UTIL,
    ]
    result = gpm_metrics(first, second, ids)
    metrics = [result.metrics[i] for i in range(len(ids))]
    assert [m.metricId for m in metrics] == ids
    assert [m.nvmlReturn for m in metrics] == [0] * 5 + [pynvml.NVML_ERROR_NOT_SUPPORTED]
    assert [m.value for m in metrics[:5]] == [90.5, 45.0, 61.25, 55.0, 99.0]
    assert metrics[3].metricInfo.shortName == b"dram_bw_util"
    assert metrics[3].metricInfo.unit == b"%"
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        gpm_metrics(second, first, ids)  # samples out of order
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlGpmSampleGet(handle(1), first)
    pynvml.nvmlGpmSampleFree(first)
    pynvml.nvmlGpmSampleFree(second)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlGpmSampleFree(first)


def test_a_refused_gpm_sample_stays_allocated_until_freed(
    gpus: FakeGpus, fake_library: Path
) -> None:
    outstanding = ctypes.CDLL(str(fake_library)).fakenvml_gpm_samples_outstanding
    outstanding.restype = ctypes.c_uint
    gpus.start(
        "device 0\ndevice 1\n"
        "fault 0 no_permission nvmlGpmSampleGet - -\n"
        "fault 1 no_permission nvmlGpmQueryDeviceSupport 10 20\n",
        at=15,
    )
    refused, healthy = handle(0), handle(1)
    assert outstanding() == 0
    first, second = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
    assert outstanding() == 2
    assert pynvml.nvmlGpmQueryDeviceSupport(refused).isSupportedDevice == 1
    with pytest.raises(pynvml.NVMLError_NoPermission):
        pynvml.nvmlGpmSampleGet(refused, first)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        pynvml.nvmlGpmQueryDeviceSupport(healthy)
    pynvml.nvmlGpmSampleGet(healthy, second)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        gpm_metrics(first, second, [pynvml.NVML_GPM_METRIC_SM_UTIL])  # first was never taken
    assert outstanding() == 2
    pynvml.nvmlGpmSampleFree(first)
    assert outstanding() == 1
    pynvml.nvmlGpmSampleFree(second)
    assert outstanding() == 0

    pynvml.nvmlGpmSampleAlloc()  # leaked ...
    assert outstanding() == 1
    gpus.stop()  # ... until the last nvmlShutdown frees everything
    assert outstanding() == 0


MALFORMED = [
    ("device 0\nat 0 0 bogus_key 1\n", 2, "unknown key 'bogus_key'"),
    ("device 0\n\n# fine\nat 0 0 power_mw lots\n", 4, "bad number 'lots' for key 'power_mw'"),
    ("at 0 0 power_mw 1\n", 1, "device 0 is not declared"),
    ("device 1\n", 1, "devices must be declared in order 0..N-1: expected device 0, got 1"),
    ('device 0 name "unterminated\n', 1, "unterminated double-quoted string"),
    ("frobnicate 1\n", 1, "unknown directive 'frobnicate'"),
    ("device 0\nfault 0 unsupported nvmlDeviceGetNothing - -\n", 2, "unknown function"),
    ("device 0\nat 0 0 energy_mj 5\n", 2, "key 'energy_mj' is static"),
    ("device 0\nat 0 0 sm_clock_mhz 1.5\n", 2, "key 'sm_clock_mhz' takes an integer, not '1.5'"),
    ("device 0 pci_bus_id 17:00\n", 1, "bad pci_bus_id"),
    ("set time_scale 0\n", 1, "bad time_scale"),
    ("device 0\nmig 0 1 0 MIG-a 1\n", 2, "device 0 is not in MIG mode"),
    ("device 0 mig_mode 1\nmig 0 1 0 GPU-a 1\n", 2, "a MIG device's uuid starts with 'MIG-'"),
    (
        "device 0 mig_mode 1 max_mig_devices 1\nmig 0 1 0 MIG-a 1\nmig 0 2 0 MIG-b 1\n",
        3,
        "device 0 already has max_mig_devices (1) MIG devices",
    ),
    (
        "device 0 mig_mode 1\nmig 0 1 0 MIG-a 1\nmig 0 1 0 MIG-b 1\n",
        3,
        "device 0 already has GPU instance 1",
    ),
    ("device 0 mig_mode 1\nmig 0 1 0 MIG-a 1\nmig 0 2 0 MIG-a 1\n", 3, "MIG uuid MIG-a is"),
    (
        "device 0 mig_mode 1\nmig 0 1 0 MIG-a 1\ndevice 0 mig_mode 0\n",
        3,
        "mig_mode is 0 or 1, and stays 1",
    ),
    ("device 0 mig_mode 2\n", 1, "mig_mode is 0 or 1"),
    ("device 0 max_mig_devices 17\n", 1, "max_mig_devices is at most 16"),
    ("device 0\nprocess 0:0 1 1 - -\n", 2, "MIG device 0:0 is not declared"),
    ("device 0\nfault 0: lost - - -\n", 2, "bad device '0:'"),
    ("device 0 cpu_affinity 3-1\n", 1, "bad cpu_affinity '3-1'"),
    ("device 0 cpu_affinity 0,,2\n", 1, "bad cpu_affinity '0,,2'"),
    ("device 0 cpu_affinity 4096\n", 1, "bad cpu_affinity '4096'"),
    ("device 0\nat 0 0 numa_node 1\n", 2, "key 'numa_node' is static"),
]


@pytest.mark.parametrize(("text", "line", "message"), MALFORMED)
def test_a_malformed_scenario_fails_init_naming_file_and_line(
    gpus: FakeGpus, capfd: pytest.CaptureFixture[str], text: str, line: int, message: str
) -> None:
    path = gpus.point_at(text)
    with pytest.raises(pynvml.NVMLError_Unknown):
        gpus.init()
    stderr = capfd.readouterr().err
    assert f"fakenvml: {path}:{line}: {message}" in stderr
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_a_missing_scenario_fails_init(
    gpus: FakeGpus, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus.point_at(Path("/nonexistent/scenario.scn"))
    with pytest.raises(pynvml.NVMLError_Unknown):
        gpus.init()
    assert "/nonexistent/scenario.scn: cannot open scenario" in capfd.readouterr().err
    monkeypatch.delenv("FAKENVML_SCENARIO")
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        gpus.init()
    assert "FAKENVML_SCENARIO is not set" in capfd.readouterr().err


OMITTED_PROBE = """
import pynvml
pynvml.nvmlInit()
with open("/proc/self/maps") as maps:
    print(next(line.split()[-1] for line in maps if "libnvidia-ml.so.1" in line))
gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
print(pynvml.nvmlDeviceGetTemperature(gpu, pynvml.NVML_TEMPERATURE_GPU))
try:
    pynvml.nvmlDeviceGetTemperatureV(gpu, pynvml.NVML_TEMPERATURE_GPU)
except pynvml.NVMLError_FunctionNotFound as error:
    print(type(error).__name__, error)
pynvml.nvmlShutdown()
"""


def test_an_omitted_function_is_not_found_by_pynvml(tmp_path: Path) -> None:
    """Also shows the other way to load the fake: LD_LIBRARY_PATH in a fresh process."""
    variant = build(tmp_path / "old-driver", omit=["nvmlDeviceGetTemperatureV"])
    environment = {
        **os.environ,
        "LD_LIBRARY_PATH": str(variant.parent),
        "FAKENVML_SCENARIO": str(SCENARIOS / "two_gpus.scn"),
    }
    completed = subprocess.run(
        [sys.executable, "-c", OMITTED_PROBE],
        env=environment,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.splitlines() == [
        str(variant.resolve()),
        "31",
        "NVMLError_FunctionNotFound Function Not Found",
    ]


def test_builds_are_cached_by_sources_and_flags(tmp_path: Path) -> None:
    first = build(tmp_path / "a")
    built_at = first.stat().st_mtime_ns
    assert build(tmp_path / "a") == first
    assert first.stat().st_mtime_ns == built_at
    build(tmp_path / "a", omit=["nvmlDeviceGetFanSpeed"])
    assert first.stat().st_mtime_ns != built_at
    with pytest.raises(ValueError, match="nvmlNoSuchFunction"):
        build(tmp_path / "a", omit=["nvmlNoSuchFunction"])
    completed = subprocess.run(
        [sys.executable, str(SCENARIOS.parent / "build.py"), str(tmp_path / "b")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert Path(completed.stdout.strip()) == tmp_path / "b" / "libnvidia-ml.so.1"


def test_every_function_can_be_omitted_warning_free(tmp_path: Path) -> None:
    """Compiling all of them out at once leaves every helper unused: -Werror would say so."""
    try:
        build(tmp_path / "none", omit=exported_functions())
    except BuildError as error:
        pytest.fail(str(error))
