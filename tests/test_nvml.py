"""The NVML collector through the real pynvml bindings, against the fake NVML driver
(tests/fakenvml), which the bindings load as libnvidia-ml.so.1.

Scenario time runs ``scale`` times faster than real time; the collector gets the same scaled
clock, so the seconds it integrates are scenario seconds, as on real hardware they are real ones.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pynvml
import pytest
from conftest import FakeGpus, start_agent
from fakenvml.build import build
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from agent.archive.database import open_engine, upgrade
from agent.archive.job import ArchiveJob
from agent.archive.sink import ArchiveSink
from agent.archive.spool import Spool
from agent.exporter.metrics import AgentMetrics
from agent.telemetry.rollup import RollupBuilder
from agent.telemetry.sampler import SamplerLoop
from agent.telemetry.store import TelemetryStore
from collectors.base import Event, Sample
from collectors.nvml.collector import NvmlCollector
from collectors.nvml.fields import FIELDS, REASONS
from collectors.nvml.library import NvmlLibrary

ROOT = Path(__file__).parent.parent
SCENARIOS = Path(__file__).parent / "fakenvml" / "scenarios"
UUID0 = "GPU-00000000-1111-2222-3333-444444444444"
UUID1 = "GPU-55555555-6666-7777-8888-999999999999"

HEADER = f"""
set driver_version 550.54.15
set nvml_version 12.550.54.15
set cuda_driver_version 12040
device 0 name "NVIDIA H100 80GB HBM3" uuid {UUID0} serial 1650000000001
device 0 pci_bus_id 00000000:18:00.0
device 1 name "NVIDIA H100 80GB HBM3" uuid {UUID1} serial 1650000000002
device 1 pci_bus_id 00000000:2A:00.0
"""

# Every field the collector reads, with values chosen to be told apart after unit conversion.
EVERY_FIELD = (SCENARIOS / "every_field.scn").read_text()


def by_device(samples: Sequence[Sample]) -> dict[str, Sample]:
    return {sample.device: sample for sample in samples}


def values(sample: Sample, key: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Readings of one field, keyed by their labels beyond device and uuid."""
    return {r.labels[2:]: r.value for r in sample.readings if r.field == key}


def value(sample: Sample, key: str, *labels: tuple[str, str]) -> float:
    return values(sample, key)[labels]


def test_every_field_in_base_units_with_the_scenario_values(
    scenario: Callable[[str, float], tuple[FakeGpus, NvmlCollector]],
) -> None:
    fake, collector = scenario(EVERY_FIELD, 1.0)
    first = by_device(collector.collect())
    fake.sleep_until(0.6)  # the XID at 0.2 s has been delivered to the watcher thread
    samples = collector.collect()
    gpu = by_device(samples)[UUID0]
    t = fake.scenario_seconds(gpu.timestamp)

    (info,) = [r for r in gpu.readings if r.field == "gpu_info"]
    assert dict(info.labels) == {
        "device": "0",
        "uuid": UUID0,
        "name": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": "00000000:18:00.0",
        "serial": "1650000000001",
        "compute_capability": "9.0",
    }
    (system,) = [s for s in samples if s.device == "system"]
    assert dict(system.readings[0].labels) == {
        "driver_version": "550.54.15",
        "nvml_version": "12.550.54.15",
        "cuda_driver_version": "12.4",
    }
    assert value(gpu, "gpu_healthy") == 1.0
    assert values(gpu, "gpu_clock_hertz") == {
        (("clock", "sm"),): 1.4e9,
        (("clock", "memory"),): 2.619e9,
        (("clock", "graphics"),): 1.395e9,
    }
    assert values(gpu, "gpu_clock_max_hertz") == {
        (("clock", "sm"),): 1.98e9,
        (("clock", "memory"),): 2.619e9,
        (("clock", "graphics"),): 1.985e9,
    }
    assert value(gpu, "gpu_power_watts") == 350.0
    assert value(gpu, "gpu_power_limit_watts") == 700.0
    # Energy is the integral of 350 W from the scenario's start, on top of 5000 J.
    assert value(gpu, "gpu_energy_joules_total") == pytest.approx(5000 + 350 * t, abs=350 * 0.05)
    assert values(gpu, "gpu_temperature_celsius") == {
        (("sensor", "gpu"),): 65.0,
        (("sensor", "memory"),): 70.0,
    }
    assert values(gpu, "gpu_temperature_threshold_celsius") == {
        (("threshold", "slowdown"),): 87.0,
        (("threshold", "shutdown"),): 92.0,
    }
    assert value(gpu, "gpu_utilization_ratio") == pytest.approx(0.9)
    assert value(gpu, "gpu_memory_utilization_ratio") == pytest.approx(0.4)
    assert value(gpu, "gpu_memory_total_bytes") == 85899345920
    assert value(gpu, "gpu_memory_used_bytes") == 1073741824
    assert value(gpu, "gpu_memory_reserved_bytes") == 553648128
    assert value(gpu, "gpu_pcie_link_generation") == 4
    assert value(gpu, "gpu_pcie_link_generation_max") == 5
    assert value(gpu, "gpu_pcie_link_width") == 8
    assert value(gpu, "gpu_pcie_link_width_max") == 16
    assert values(gpu, "gpu_pcie_throughput_bytes_per_second") == {
        (("direction", "tx"),): 1000 * 1000,
        (("direction", "rx"),): 2000 * 1000,
    }
    assert value(gpu, "gpu_fan_speed_ratio") == pytest.approx(0.55)
    assert value(gpu, "gpu_performance_state") == 2
    active = values(gpu, "gpu_clock_event_reason_active")
    assert {labels[0][1] for labels, v in active.items() if v == 1.0} == {
        "gpu_idle",
        "sw_power_cap",
    }
    assert len(active) == len(REASONS)
    # The reasons seen at the first poll held until the second: their seconds are that gap.
    gap = gpu.timestamp - first[UUID0].timestamp
    seconds = values(gpu, "gpu_clock_event_reason_seconds_total")
    assert seconds[(("reason", "sw_power_cap"),)] == pytest.approx(gap)
    assert seconds[(("reason", "hw_thermal_slowdown"),)] == 0.0
    violations = values(gpu, "gpu_violation_seconds_total")
    assert violations[(("policy", "power"),)] == pytest.approx(t, abs=0.05)  # 0x4 since t=0
    assert violations[(("policy", "thermal"),)] == 0.0
    assert len(violations) == 8
    assert values(gpu, "gpu_ecc_errors_total") == {
        (("type", "corrected"),): 12,
        (("type", "uncorrected"),): 1,
    }
    assert values(gpu, "gpu_remapped_rows") == {
        (("cause", "correctable"),): 3,
        (("cause", "uncorrectable"),): 1,
    }
    assert value(gpu, "gpu_row_remap_pending") == 1.0
    assert value(gpu, "gpu_row_remap_failed") == 0.0
    assert value(gpu, "gpu_xid_errors_total", ("xid", "79")) == 1
    assert value(gpu, "gpu_xid_last_seen_timestamp_seconds", ("xid", "79")) <= gpu.timestamp
    assert value(gpu, "gpu_dram_bandwidth_utilization_ratio") == pytest.approx(0.55)
    assert value(gpu, "gpu_sm_occupancy_ratio") == pytest.approx(0.45)
    assert value(gpu, "gpu_tensor_activity_ratio") == pytest.approx(0.60)
    assert value(gpu, "gpu_foreign_compute_processes") == 1
    assert gpu.errors == ()
    # Every field of the catalogue was read (the GPM ones need the second poll), but those of
    # MIG devices and the topology, which tests/test_nvml_defects.py reads on a MIG node.
    mig_node_only = {key for key in FIELDS if key.startswith("gpu_mig_") and key != "gpu_mig_mode"}
    assert {r.field for s in samples for r in s.readings} == (
        set(FIELDS) - mig_node_only - {"gpu_topology_info"}
    )
    xids = [event for s in samples for event in s.events if event.kind == "xid"]
    assert [(e.device, dict(e.attributes)) for e in xids] == [(UUID0, {"xid": "79"})]


THERMAL = (
    HEADER
    + """
at 0 0 sm_clock_mhz 1410 reasons 0x0 gpu_temp_c 71
at 0 1 sm_clock_mhz 1410 reasons 0x0 gpu_temp_c 79
at 20 1 sm_clock_mhz 1100 reasons 0x40 gpu_temp_c 88
at 50 1 sm_clock_mhz 1410 reasons 0x0 gpu_temp_c 84
"""
)


def test_hw_thermal_slowdown_on_gpu1_only_for_its_window(
    scenario: Callable[[str, float], tuple[FakeGpus, NvmlCollector]],
) -> None:
    """Acceptance 2: 30 s of HW thermal slowdown on GPU 1, polled once a scenario second."""
    fake, collector = scenario(THERMAL, 10.0)
    reason = (("reason", "hw_thermal_slowdown"),)
    timeline: list[tuple[float, float, float]] = []  # t, GPU 0 gauge, GPU 1 gauge
    last: dict[str, Sample] = {}
    events: list[Event] = []
    for step in range(61):
        fake.sleep_until(step)
        polled = collector.collect()
        events.extend(event for sample in polled for event in sample.events)
        last = by_device(polled)
        t = fake.scenario_seconds(last[UUID1].timestamp)
        timeline.append(
            (
                t,
                values(last[UUID0], "gpu_clock_event_reason_active")[reason],
                values(last[UUID1], "gpu_clock_event_reason_active")[reason],
            )
        )
    for t, gpu0, gpu1 in timeline:
        assert gpu0 == 0.0
        if 20.3 <= t < 49.7:
            assert gpu1 == 1.0, t
        elif t < 19.7 or t >= 50.3:
            assert gpu1 == 0.0, t
    gpu1_seconds = values(last[UUID1], "gpu_clock_event_reason_seconds_total")[reason]
    # Within one sample interval (1 scenario second when the machine keeps up; the widest
    # actual gap when it does not).
    times = [t for t, _, _ in timeline]
    interval = max(b - a for a, b in itertools.pairwise(times))
    assert gpu1_seconds == pytest.approx(30.0, abs=max(1.0, interval))
    assert values(last[UUID0], "gpu_clock_event_reason_seconds_total")[reason] == 0.0
    violations = values(last[UUID1], "gpu_violation_seconds_total")
    assert violations[(("policy", "thermal"),)] == pytest.approx(30.0, abs=1e-6)
    assert values(last[UUID0], "gpu_violation_seconds_total")[(("policy", "thermal"),)] == 0.0
    # The episode is one archive event, on GPU 1, written when it ended.
    (episode,) = [e for e in events if e.kind == "throttle_episode"]
    attributes = dict(episode.attributes)
    assert (episode.device, attributes["reason"]) == (UUID1, "hw_thermal_slowdown")
    assert float(attributes["seconds"]) == pytest.approx(30.0, abs=max(1.0, interval))
    assert fake.scenario_seconds(float(attributes["started"])) == pytest.approx(20.0, abs=interval)


LOST = (
    HEADER
    + """
at 0 0 sm_clock_mhz 1410 power_mw 500000
at 0 1 sm_clock_mhz 1410 power_mw 500000
fault 0 lost - 10 20
"""
)


def test_gpu0_lost_and_back_while_gpu1_keeps_reporting(
    scenario: Callable[[str, float], tuple[FakeGpus, NvmlCollector]], tmp_path: Path
) -> None:
    """Acceptance 3: through a sampler loop, as the agent runs it."""
    fake, collector = scenario(LOST, 10.0)
    engine = open_engine(f"sqlite:///{tmp_path}/archive.db")
    upgrade(engine)
    job = ArchiveJob(
        RollupBuilder({"nvml": dict(FIELDS)}, 60, fake.clock()),
        ArchiveSink(engine, "node-a", Spool(tmp_path / "spool.db")),
        retention_days=1,
    )
    seen: list[Sample] = []
    loop = SamplerLoop(collector, 0.1, sinks=(seen.append, job.add_events), stall_seconds=5)
    loop.start()
    fake.sleep_until(32)
    loop.request_stop()
    assert loop.join(2)

    gpu1 = [s for s in seen if s.device == UUID1]
    gpu0 = [s for s in seen if s.device == UUID0]
    assert len(gpu1) == len(gpu0) >= 15  # 32 polls on an idle machine
    assert all(value(s, "gpu_power_watts") == 500.0 for s in gpu1)  # every sample, all along
    health = [(fake.scenario_seconds(s.timestamp), value(s, "gpu_healthy")) for s in gpu0]
    assert all(h == 1.0 for t, h in health if t < 9.7)
    assert all(h == 0.0 for t, h in health if 10.3 <= t < 19.7)
    assert health[-1][1] == 1.0  # found again after the window (retried every 5 s)
    lost = [s for s in gpu0 if value(s, "gpu_healthy") == 0.0]
    assert all(len(s.readings) == 1 for s in lost)  # nothing but the health of a lost GPU
    kinds = [e.kind for s in seen for e in s.events]
    assert kinds == ["device_lost", "device_recovered"]
    status = loop.status()
    assert status.errors.get("device_lost", 0) == 1
    assert status.up
    job.run()
    assert job.sink.drain()
    with engine.connect() as connection:
        archived = connection.execute(
            text("SELECT kind, device, node FROM events ORDER BY occurred_at")
        ).all()
    engine.dispose()
    assert [tuple(row) for row in archived] == [
        ("device_lost", UUID0, "node-a"),
        ("device_recovered", UUID0, "node-a"),
    ]


UNSUPPORTED = (
    HEADER
    + """
at 0 0 fan_pct 40 power_mw 300000
at 0 1 fan_pct 45 power_mw 310000
fault 1 unsupported nvmlDeviceGetFanSpeed - -
fault 0 timeout nvmlDeviceGetPowerUsage - -
fault 0 timeout field:186 - -
fault 1 no_permission nvmlDeviceGetTotalEnergyConsumption - -
"""
)


def test_unsupported_field_is_absent_for_that_device_only(
    scenario: Callable[[str, float], tuple[FakeGpus, NvmlCollector]],
) -> None:
    """Acceptance 4, on the exposition that /metrics serves; plus a timeout and no permission."""
    _, collector = scenario(UNSUPPORTED, 1.0)
    store = TelemetryStore(16)
    loop = SamplerLoop(collector, 1.0, sinks=(store.record,), stall_seconds=5)
    loop.poll_once()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentMetrics(store, {"nvml": dict(FIELDS)}, lambda: [loop.status()], 15.0))
    exposed = {
        family.name: {sample.labels["uuid"] for sample in family.samples if "uuid" in sample.labels}
        for family in text_string_to_metric_families(generate_latest(registry).decode())
    }
    assert exposed["sustain_gpu_fan_speed_ratio"] == {UUID0}
    # GPU 0 timed out (the instant field and the fallback call): no value, no 0
    assert exposed["sustain_gpu_power_watts"] == {UUID1}
    assert exposed["sustain_gpu_energy_joules"] == {UUID0}
    assert exposed["sustain_gpu_clock_hertz"] == {UUID0, UUID1}
    # The timeouts are counted (the instant power field's and the fallback call's);
    # not-supported and no-permission are states, not errors.
    assert loop.status().errors == {"timeout": 2}


def run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SUSTAIN_", "FAKENVML"))}
    full_env.update(env)
    full_env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=full_env,
        check=False,
    )


POLL_AND_PRINT = """
import json, logging, time
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
from collectors.nvml.collector import NvmlCollector
from collectors.base import SourceUnavailable
collector = NvmlCollector()
out = []
for _ in range(3):
    try:
        samples = collector.collect()
    except SourceUnavailable as exc:
        out.append({"absent": exc.reason})
        continue
    out.append({s.device: sorted({r.field for r in s.readings}) for s in samples})
    time.sleep(0.05)
collector.close()
print(json.dumps(out))
"""


def test_older_driver_without_the_current_calls_uses_the_fallbacks(tmp_path: Path) -> None:
    """FunctionNotFound for the current calls: the deprecated ones give the same fields, and
    each missing function is logged once, not once per poll."""
    missing = [
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetTemperatureV",
        "nvmlDeviceGetFieldValues",
        "nvmlGpmQueryDeviceSupport",
    ]
    library = build(tmp_path / "old", omit=missing)
    path = tmp_path / "scenario.scn"
    path.write_text(EVERY_FIELD)
    result = run_python(
        POLL_AND_PRINT,
        {"LD_LIBRARY_PATH": str(library.parent), "FAKENVML_SCENARIO": str(path)},
    )
    assert result.returncode == 0, result.stderr
    polls = json.loads(result.stdout)
    fields = set(polls[-1][UUID0])
    assert {
        "gpu_clock_event_reason_active",
        "gpu_clock_event_reason_seconds_total",
        "gpu_violation_seconds_total",
        "gpu_temperature_celsius",
        "gpu_ecc_errors_total",
    } <= fields
    assert "gpu_sm_occupancy_ratio" not in fields  # no GPM on this driver: absent
    for name in missing:
        assert result.stderr.count(f"lacks {name}") == 1, result.stderr


def test_no_library_is_absent_with_one_log_line(tmp_path: Path) -> None:
    """No libnvidia-ml.so.1 at all (this machine, a CPU-only node): the source is absent, said
    once, and not looked for again at every poll."""
    result = run_python(POLL_AND_PRINT, {"LD_LIBRARY_PATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    polls = json.loads(result.stdout)
    assert polls == [{"absent": "library_not_found"}] * 3
    assert result.stderr.count("NVML unavailable") == 1, result.stderr
    assert "not an error" in result.stderr
    assert "Traceback" not in result.stderr


class ManualClock:
    """Monotonic seconds that a test moves on by hand: NVML's retry waits without the wait."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def poll_until(loop: SamplerLoop, clock: ManualClock, end: float, step: float = 10.0) -> float:
    """Poll every ``step`` seconds of ``clock`` until the collector is up; the time it came up,
    or ``end``."""
    while clock.now < end:
        loop.poll_once()
        status = loop.status()
        if status.up:
            return clock.now
        clock.now += step
    return end


def test_driver_not_loaded_is_absent_then_picked_up_at_the_next_retry(
    fake_nvml: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The fake library without a scenario answers NVML_ERROR_DRIVER_NOT_LOADED, as the real one
    does before its kernel module is loaded; setting the scenario is the driver being loaded.
    Retries back off 60, 120, 240, then every 300 s; no error is counted meanwhile."""
    monkeypatch.delenv("FAKENVML_SCENARIO", raising=False)
    clock = ManualClock()
    collector = NvmlCollector(library=NvmlLibrary(clock=clock))
    loop = SamplerLoop(collector, 1.0, sinks=(), stall_seconds=30)
    try:
        with caplog.at_level(logging.INFO, logger="collectors.nvml"):
            # Loaded at 800 s: found at the retry at 1020 s (0 + 60 + 120 + 240 + 300 + 300),
            # not at 1260 s (an uncapped doubling) nor at the next poll.
            assert poll_until(loop, clock, end=800) == 800
            status = loop.status()
            assert (status.up, status.absent, status.errors) == (False, "driver_not_loaded", {})
            path = tmp_path / "scenario.scn"
            path.write_text(HEADER)
            monkeypatch.setenv("FAKENVML_SCENARIO", str(path))
            assert poll_until(loop, clock, end=2000) == 1020
        status = loop.status()
        assert (status.up, status.absent, status.errors) == (True, None, {})
        assert {sample.device for sample in collector.collect()} == {"system", UUID0, UUID1}
        absent_lines = [r for r in caplog.records if "NVML unavailable" in r.getMessage()]
        assert len(absent_lines) == 1, caplog.text
        assert "Driver Not Loaded (driver_not_loaded)" in absent_lines[0].getMessage()
    finally:
        collector.close()


def test_a_driver_that_fails_to_start_is_down_and_counted(
    fake_nvml: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A driver that is there and fails (the fake one on a scenario it cannot read answers
    NVML_ERROR_UNKNOWN) is a fault, not an absence: down, counted at every poll, tried again
    every 60 s, and picked up once it starts."""
    path = tmp_path / "scenario.scn"
    path.write_text("no such directive\n")
    monkeypatch.setenv("FAKENVML_SCENARIO", str(path))
    clock = ManualClock()
    collector = NvmlCollector(library=NvmlLibrary(clock=clock))
    loop = SamplerLoop(collector, 1.0, sinks=(), stall_seconds=30)
    try:
        assert poll_until(loop, clock, end=100) == 100
        status = loop.status()
        assert (status.up, status.absent, status.errors) == (False, None, {"collect": 10})
        path.write_text(HEADER)
        assert poll_until(loop, clock, end=300) == 120  # tried at 0, 60, 120
        assert loop.status().up
    finally:
        collector.close()


def test_sustain_run_serves_gpu_families_with_the_fake_driver(
    fake_nvml: Path, tmp_path: Path
) -> None:
    """Acceptance 5: the real daemon, the fake driver found through LD_LIBRARY_PATH."""
    path = tmp_path / "scenario.scn"
    path.write_text(THERMAL)
    running = start_agent(
        tmp_path, env={"LD_LIBRARY_PATH": str(fake_nvml.parent), "FAKENVML_SCENARIO": str(path)}
    )
    try:
        body = running.wait_for("sustain_gpu_clock_event_reason_seconds_total")
    finally:
        code, _, err = running.terminate()
    assert code == 0, err
    families = {f.name: f for f in text_string_to_metric_families(body)}
    up = {s.labels["collector"]: s.value for s in families["sustain_collector_up"].samples}
    assert up == {"host": 1.0, "nvml": 1.0}
    clocks = {
        (s.labels["uuid"], s.labels["clock"]): s.value
        for s in families["sustain_gpu_clock_hertz"].samples
    }
    assert clocks[(UUID0, "sm")] == 1.41e9
    assert "sustain_gpu_clock_event_reason_seconds" in families
    assert "NVML: driver 550.54.15, 2 GPU(s)" in err


def test_driver_upgrade_at_a_scenario_time(
    scenario: Callable[[str, float], tuple[FakeGpus, NvmlCollector]],
) -> None:
    """`upgrade TIME VERSION`: the driver version the stack snapshots read changes mid-run."""
    fake, collector = scenario(
        'set driver_version 550.54.15\ndevice 0 name "NVIDIA H100 80GB HBM3" uuid GPU-a\n'
        "upgrade 2 555.42.02\n",
        10.0,
    )
    library = collector.library
    library.start()
    assert library.call(pynvml.nvmlSystemGetDriverVersion) == "550.54.15"
    fake.sleep_until(2.5)
    assert library.call(pynvml.nvmlSystemGetDriverVersion) == "555.42.02"
