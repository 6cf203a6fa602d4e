"""The NVML defects a line-by-line reading against the NVML documentation found (issue 14, 5-7
and 9), each shown on the fake driver through the real pynvml bindings: GPM samples that leaked,
a power gauge that was a 1 s average, MIG devices nobody saw, and a CUDA driver version printed
as a raw integer.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from conftest import FakeGpus
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.exporter.metrics import AgentMetrics
from agent.telemetry.sampler import SamplerLoop
from agent.telemetry.store import TelemetryStore
from collectors.base import Sample
from collectors.nvml.collector import NvmlCollector
from collectors.nvml.fields import FIELDS
from collectors.stack import capture

Scenario = Callable[[str, float], tuple[FakeGpus, NvmlCollector]]
SCENARIOS = Path(__file__).parent / "fakenvml" / "scenarios"
MIG_A = "MIG-11111111-1111-4111-8111-111111111111"
MIG_B = "MIG-22222222-2222-4222-8222-222222222222"


def outstanding(library: Path) -> int:
    """GPM samples the fake has handed out and not had back."""
    count: int = ctypes.CDLL(str(library)).fakenvml_gpm_samples_outstanding()
    return count


def field_values(samples: Sequence[Sample], key: str) -> dict[str, float]:
    return {
        sample.device: reading.value
        for sample in samples
        for reading in sample.readings
        if reading.field == key
    }


@pytest.mark.slow
def test_gpm_samples_leak_no_more_when_gpm_is_refused(
    scenario: Scenario, fake_nvml: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Defect 5, acceptance 3: GPM refused with NVML_ERROR_NO_PERMISSION (a non-privileged
    container) for 10 minutes of scenario time, polled at 1 Hz on 8 GPUs: no sample is left
    allocated, the refusal is logged once per GPU and counted once per GPU, and GPM is not
    asked again (no GPM field in any sample)."""
    text = "set time_scale 60\n" + "".join(
        f"device {d}\nfault {d} no_permission nvmlGpmSampleGet - -\n" for d in range(8)
    )
    fake, collector = scenario(text, 60.0)
    caplog.set_level(logging.WARNING, logger="collectors.nvml.collector")
    errors = 0
    gpm_readings = 0
    for second in range(600):
        fake.sleep_until(second)
        for sample in collector.collect():
            errors += sample.errors.count("gpm_no_permission")
            gpm_readings += sum(r.field == "gpu_sm_occupancy_ratio" for r in sample.readings)
    assert outstanding(fake_nvml) == 0
    refusals = [r for r in caplog.records if "GPM refused" in r.getMessage()]
    assert len(refusals) == 8
    assert len({r.args[0] for r in refusals if isinstance(r.args, tuple)}) == 8  # one per GPU
    assert errors == 8
    assert gpm_readings == 0


def test_gpm_samples_leak_no_more_when_a_gpu_is_lost(scenario: Scenario, fake_nvml: Path) -> None:
    """Defect 5: a GPU lost while GPM runs gives its kept sample back; so does close()."""
    text = "set time_scale 10\ndevice 0\ndevice 1\nfault 1 lost - 3 -\n"
    fake, collector = scenario(text, 10.0)
    for second in (0.5, 1.5, 2.5):
        fake.sleep_until(second)
        collector.collect()
    assert outstanding(fake_nvml) == 2  # one kept per GPU, for the next poll's metrics
    fake.sleep_until(3.5)
    samples = collector.collect()
    assert "device_lost" in [e for s in samples for e in s.errors]
    assert outstanding(fake_nvml) == 1
    collector.close()
    assert outstanding(fake_nvml) == 0


def test_power_gauge_is_the_instant_reading_not_the_1s_average(scenario: Scenario) -> None:
    """Defect 6: nvmlDeviceGetPowerUsage is a 1 s average on Ampere and newer; the gauge is
    NVML_FI_DEV_POWER_INSTANT, the average its own series; without the instant field (older
    drivers) the gauge falls back to nvmlDeviceGetPowerUsage."""
    text = (
        "device 0\ndevice 1\n"
        "at 0 0 power_mw 612000 power_average_mw 401000\n"
        "at 0 1 power_mw 612000 power_average_mw 401000\n"
        "fault 1 unsupported field:186 - -\n"
    )
    _, collector = scenario(text, 1.0)
    samples = collector.collect()
    power = field_values(samples, "gpu_power_watts")
    average = field_values(samples, "gpu_power_average_watts")
    gpu0, gpu1 = (s.device for s in samples if s.device != "system")
    assert power[gpu0] == 612.0
    assert average[gpu0] == 401.0
    assert power[gpu1] == 401.0  # the fallback call, the driver's average
    assert average[gpu1] == 401.0


def test_nvml_info_cuda_driver_version_reads_like_the_stack_snapshot(scenario: Scenario) -> None:
    """Defect 9: one format everywhere: "12.4", not "12040"."""
    _, collector = scenario("set cuda_driver_version 12040\ndevice 0\n", 1.0)
    (system,) = [s for s in collector.collect() if s.device == "system"]
    labels = dict(system.readings[0].labels)
    snapshot = capture(torch_facts=None, nvml=collector.library)
    assert labels["cuda_driver_version"] == "12.4"
    assert snapshot.facts["driver"]["cuda_version"] == labels["cuda_driver_version"]


def exposition(collector: NvmlCollector) -> dict[str, list[dict[str, str]]]:
    store = TelemetryStore(16)
    loop = SamplerLoop(collector, 1.0, sinks=(store.record,), stall_seconds=5)
    loop.poll_once()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentMetrics(store, {"nvml": dict(FIELDS)}, lambda: [loop.status()], 15.0))
    return {
        family.name: [sample.labels for sample in family.samples]
        for family in text_string_to_metric_families(generate_latest(registry).decode())
    }


def test_mig_devices_are_seen_and_exported(scenario: Scenario) -> None:
    """Defect 7, the collector's half: a MIG GPU's instances are enumerated (UUIDs, GPU
    instance ids, memory, processes) and exported with bounded labels beside the plain GPU."""
    _, collector = scenario((SCENARIOS / "mig_node.scn").read_text(), 1.0)
    families = exposition(collector)
    info = {labels["uuid"]: labels for labels in families["sustain_gpu_mig_info"]}
    assert set(info) == {MIG_A, MIG_B}
    parent = info[MIG_A]["parent"]
    assert info[MIG_B]["parent"] == parent
    assert {labels["mig_instance"] for labels in info.values()} == {"1", "2"}
    assert {labels["device"] for labels in info.values()} == {"0"}
    gpus = {labels["uuid"] for labels in families["sustain_gpu_info"]}
    assert {labels["uuid"] for labels in families["sustain_gpu_mig_mode"]} == gpus
    totals = {labels["uuid"] for labels in families["sustain_gpu_mig_memory_total_bytes"]}
    assert totals == {MIG_A, MIG_B}
    plain = {labels["uuid"] for labels in families["sustain_gpu_info"]} - {parent}
    assert len(plain) == 1
    # The MIG GPU's utilization reads N/A: absent, never 0; the plain GPU's is there.
    assert {labels["uuid"] for labels in families["sustain_gpu_utilization_ratio"]} == plain
    topology = {labels["uuid"]: labels for labels in families["sustain_gpu_topology_info"]}
    assert topology[parent]["cpu_affinity"] == "0"
    assert topology[next(iter(plain))]["cpu_affinity"] == "1"
