"""Device health (issue 16): the verdict per device from what the agent knows, `sustain health`
with and without the daemon, operators' acknowledgements, and the fleet baseline.

The scenarios run the real agent (`sustain run`) on the fake NVML driver: each GPU of one
scenario plays one rule, beside controls that must stay healthy.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import FakeGpus, Running, fetch, start_agent
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, insert, select
from sqlalchemy.engine import Engine
from test_daemon import STARTUP_SECONDS, quick_env
from test_database_urls import forked_sustain
from test_probes import FOREIGN, OK, archived, child, make_scheduler

from agent.archive import fleet_baselines
from agent.archive.database import open_engine, upgrade
from agent.archive.events import EventWriter
from agent.archive.models import EventRecord, ProbeRunRecord
from agent.cli.health import NodeHealth, Verdict, summary
from agent.config.archive_section import OccupancySection
from agent.config.health_section import HealthSection
from agent.health.monitor import HealthMonitor
from agent.health.records import baseline, xids
from agent.health.rules import Finding
from agent.occupancy.tracker import Occupancy
from agent.probes.analysis import RunAnalysis
from agent.probes.attribution import Attribution
from agent.probes.node import Coupling
from agent.probes.runner import CPU, ProbeDevice, ProbeRun, ProbeSpec
from agent.telemetry.store import TelemetryStore
from collectors.base import Event, Reading, Sample
from collectors.nvml.collector import NvmlCollector

MIG_UUID = "MIG-99999999-9999-4999-8999-999999999999"

# GPU 0: busy, healthy. 1: XID 79, and again at t=24. 2: uncorrectable ECC, remap pending.
# 3: HW thermal slowdown at 0% utilization. 4: PCIe gen 3 on a gen 5 link under load.
# 5: HW thermal slowdown under full load (the load's doing: healthy). 6: 500 corrected ECC
# errors. 7: power brake while idle. 8: clocks held by the applications-clocks setting under
# load. 9: in MIG mode, XID 79 on the GPU: its MIG device is unhealthy too. 10: PCIe gen 3 idle
# (links train down at idle: healthy). 11: lost from second 3.
DEVICES = "".join(f"device {i}\n" for i in range(12))
SCENARIO = f"""
set time_scale 1
{DEVICES}
at 0 0 gpu_util_pct 95 reasons 0x4 sm_clock_mhz 1755
at 0 1 gpu_util_pct 0 reasons 0x1
xid 1 2 79
xid 1 24 79
xid 1 60 79
xid 1 120 79
at 0 2 ecc_uncorrected 1 remapped_uncorrected 1 remapped_pending 1
at 0 3 gpu_util_pct 0 reasons 0x41 gpu_temp_c 91
at 0 4 gpu_util_pct 90 reasons 0x0 pcie_gen 3
at 0 5 gpu_util_pct 100 reasons 0x40 gpu_temp_c 88
at 0 6 ecc_corrected 10
at 3 6 ecc_corrected 510
at 0 7 gpu_util_pct 5 reasons 0x80
at 0 8 gpu_util_pct 90 reasons 0x2 sm_clock_mhz 1410
device 9 mig_mode 1
mig 9 1 0 {MIG_UUID} 42949672960
xid 9 2 79
at 0 10 gpu_util_pct 0 reasons 0x1 pcie_gen 3
fault 11 lost - 3 -
"""

CONFIG = """
[probing]
enabled = false
[health]
hold_seconds = 1
"""


def _gpu(index: int) -> str:
    return f"GPU-fa4e0000-0000-4000-8000-{index:012x}"


def _sustain(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`python -m agent ARGS`, forked from tests/test_database_urls.py's zygote."""
    return forked_sustain(args, os.environ, timeout)


def _health(running: Running) -> dict[tuple[str, str], tuple[str, set[str], set[str]]]:
    """(device, uuid) -> (state, reasons, acknowledged) from the agent's /metrics."""
    _, body = fetch(running.base + "/metrics")
    found: dict[tuple[str, str], tuple[str, set[str], set[str]]] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            labels = sample.labels
            key = (labels.get("device", ""), labels.get("uuid", ""))
            if sample.name == "sustain_device_health":
                state, reasons, acknowledged = found.get(key, ("", set(), set()))
                found[key] = (
                    labels["state"] if sample.value == 1 else state,
                    reasons,
                    acknowledged,
                )
            elif sample.name == "sustain_device_health_reason":
                found.setdefault(key, ("", set(), set()))[1].add(labels["reason"])
            elif sample.name == "sustain_device_health_acknowledged":
                found.setdefault(key, ("", set(), set()))[2].add(labels["reason"])
    return found


def _wait(running: Running, check: Any, timeout: float = 60.0) -> dict[Any, Any]:
    running.wait_for("sustain_device_health{", timeout=STARTUP_SECONDS)
    deadline = time.monotonic() + timeout
    health: dict[Any, Any] = {}
    while time.monotonic() < deadline:
        health = _health(running)
        if health and check(health):
            return health
        time.sleep(0.3)
    pytest.fail(f"health did not reach the expected verdict in {timeout} s: {health}")


@pytest.fixture
def fake_node(fake_nvml: Path, tmp_path: Path) -> Iterator[tuple[Running, list[str]]]:
    scenario = tmp_path / "node.scn"
    scenario.write_text(SCENARIO)
    config = tmp_path / "sustain.toml"
    config.write_text(CONFIG)
    data = tmp_path / "data"
    running = start_agent(
        data,
        "--config",
        str(config),
        env=quick_env(
            tmp_path,
            LD_LIBRARY_PATH=str(fake_nvml.parent),
            FAKENVML_SCENARIO=str(scenario),
        ),
    )
    flags = ["--config", str(config), "--data-dir", str(data)]
    try:
        yield running, flags
    finally:
        if running.process.poll() is None:
            running.terminate()


def _occurred(data: Path, kind: str, device: str) -> list[datetime]:
    """When each archived event of ``kind`` on ``device`` happened, oldest first."""
    engine = create_engine(f"sqlite:///{data / 'sustain.db'}")
    try:
        with engine.connect() as connection:
            times = connection.scalars(
                select(EventRecord.occurred_at)
                .where(EventRecord.kind == kind, EventRecord.device == device)
                .order_by(EventRecord.occurred_at)
            ).all()
    finally:
        engine.dispose()
    return list(times)


def _events(data: Path, kind: str) -> list[EventRecord]:
    engine = create_engine(f"sqlite:///{data / 'sustain.db'}")
    try:
        with engine.connect() as connection:
            rows = connection.execute(
                select(EventRecord.device, EventRecord.attributes, EventRecord.message).where(
                    EventRecord.kind == kind
                )
            ).all()
    finally:
        engine.dispose()
    return rows  # type: ignore[return-value]


@pytest.mark.slow  # a whole probe command end to end (left out of the quick tier)
def test_each_rule_on_the_fake_driver_and_sustain_health(
    fake_node: tuple[Running, list[str]],
) -> None:
    running, flags = fake_node
    metrics = ["--metrics", running.base + "/metrics"]
    expected = {
        1: ("unhealthy", {"xid_79"}),
        2: ("unhealthy", {"row_remap_pending"}),
        3: ("degraded", {"thermal_while_idle"}),
        4: ("degraded", {"pcie_link_degraded"}),
        6: ("degraded", {"correctable_ecc_rate"}),
        7: ("degraded", {"power_brake_while_idle"}),
        8: ("degraded", {"applications_clocks_below_max"}),
        9: ("unhealthy", {"xid_79"}),
        11: ("unhealthy", {"device_lost"}),
    }

    def settled(health: dict[Any, Any]) -> bool:
        return (
            all(health.get((str(i), _gpu(i)), ("",))[:2] == want for i, want in expected.items())
            and health.get(("9", MIG_UUID), ("",))[0] == "unhealthy"
        )

    health = _wait(running, settled)
    for control in (0, 5, 10):
        assert health[(str(control), _gpu(control))] == ("healthy", set(), set()), control
    assert health[("9", MIG_UUID)][1] == {"xid_79"}
    assert health[("cpu", "")][0] == "healthy"

    # An operator clears GPU 1: recorded with who and why; it counts as healthy again ...
    cleared = _sustain("health", "clear", "1", "--reason", "reseated", "--by", "alice", *flags)
    assert cleared.returncode == 0, cleared.stderr
    assert "xid_79 acknowledged by alice" in cleared.stdout
    (record,) = _events(running.data_dir, "health_clear")
    attributes = json.loads(record.attributes)
    assert record.device == _gpu(1)
    assert (attributes["by"], attributes["why"], attributes["reasons"]) == (
        "alice",
        "reseated",
        "xid_79",
    )
    # The clear covers what came before it; the scenario's next XID 79 (second 24, 60 or 120: a
    # loaded machine may take more than 24 s to settle) makes GPU 1 unhealthy again. Healthy is
    # seen in between, unless that XID came first (archived with a time after the clear's).
    cleared_at = _occurred(running.data_dir, "health_clear", _gpu(1))[0]
    health = _wait(
        running,
        lambda h: (
            h[("1", _gpu(1))][0] == "healthy"
            or any(at > cleared_at for at in _occurred(running.data_dir, "xid", _gpu(1)))
        ),
    )
    if health[("1", _gpu(1))][0] == "healthy":
        assert health[("1", _gpu(1))] == ("healthy", set(), {"xid_79"})
    # ... until new evidence: the next XID 79 after the clear.
    health = _wait(running, lambda h: h[("1", _gpu(1))][0] == "unhealthy", timeout=150)
    assert health[("1", _gpu(1))][1] == {"xid_79"}

    # `sustain health` as node-problem-detector runs it: exit 1, the summary names the GPUs.
    result = _sustain("health", "--summary", *flags, *metrics)
    assert result.returncode == 1, result.stderr
    line = result.stdout.strip()
    assert "\n" not in line
    assert len(line) <= 80, line
    assert line.startswith("unhealthy: GPU 1 xid_79")
    result = _sustain("health", "--json", *flags, *metrics)
    assert result.returncode == 1
    verdict = json.loads(result.stdout)
    assert verdict["source"] == "live"
    assert verdict["state"] == "unhealthy"
    by_uuid = {device["uuid"]: device for device in verdict["devices"]}
    assert by_uuid[_gpu(0)]["state"] == "healthy"
    (xid,) = by_uuid[_gpu(1)]["reasons"]
    assert xid["reason"] == "xid_79"
    assert "fallen off the bus" in xid["evidence"]
    (pcie,) = by_uuid[_gpu(4)]["reasons"]
    assert pcie["evidence"].startswith("PCIe gen 3 x16 on a gen 5 x16 link at 90% utilization")
    text = _sustain("health", *flags, *metrics).stdout.splitlines()
    assert any(line.startswith("GPU 1 ") and "xid_79: XID 79" in line for line in text)

    # Each change is in the archive with its evidence; without the daemon, the archive answers.
    code, _, _ = running.terminate()
    assert code == 0
    changes = [
        json.loads(row.attributes)
        for row in _events(running.data_dir, "health_change")
        if row.device == _gpu(2)
    ]
    assert changes[-1]["state"] == "unhealthy"
    (finding,) = json.loads(changes[-1]["findings"])
    assert finding["reason"] == "row_remap_pending"
    assert "1 uncorrected ECC errors" in finding["evidence"]
    offline = _sustain("health", *flags)
    assert offline.returncode == 1, offline.stderr
    assert "from the archive" in offline.stdout
    assert any(
        line.startswith("GPU 2 ") and "row_remap_pending" in line
        for line in offline.stdout.splitlines()
    )


def test_health_without_agent_or_archive_is_unknown(tmp_path: Path) -> None:
    result = _sustain(
        "health", "--data-dir", str(tmp_path), "--metrics", "http://127.0.0.1:9/metrics"
    )
    assert result.returncode == 2
    assert result.stdout.startswith("unknown: the agent does not answer")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["clear", "14", "--reason", "x"], "no device '14' on this node"),
        (["clear", "1", "--reason", "  "], "--reason must say why"),
        (["--max-length", "5"], "5 is outside 20 to 4096"),
    ],
)
def test_bad_health_input_is_one_line_and_exit_2(
    fake_node: tuple[Running, list[str]], args: list[str], message: str
) -> None:
    running, flags = fake_node
    running.wait_for('sustain_device_health{device="1"', timeout=STARTUP_SECONDS)
    result = _sustain("health", *args, *flags)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_summary_stays_under_the_limit_however_many_devices() -> None:
    devices = [
        Verdict(
            _gpu(i),
            str(i),
            _gpu(i),
            f"GPU {i}",
            [
                Finding("xid_79", "unhealthy", "", 0.0),
                Finding("pcie_link_degraded", "degraded", "", 0.0),
            ],
        )
        for i in range(8)
    ]
    for device in devices:
        device.settle()
    line = summary(NodeHealth("n", "live", "", devices), 80)
    assert len(line) <= 80, line
    assert line.startswith("unhealthy: "), line
    assert summary(NodeHealth("n", "live", "", devices[:1]), 80) == (
        "unhealthy: GPU 0 pcie_link_degraded xid_79"
    )


# The fleet baseline, probe failures and node coupling: the monitor fed probe runs.

MODEL = "NVIDIA H100 80GB HBM3"
STACK = "stack-1"


def _seed(engine: Engine, node: str, device: str, steady: float, ended: float) -> None:
    with engine.begin() as connection:
        connection.execute(
            insert(ProbeRunRecord).values(
                run_id=uuid.uuid4().hex,
                node=node,
                device=device,
                device_label="0",
                workload="matmul",
                precision="bf16",
                optimization="eager",
                size="large",
                outcome="ok",
                reason="",
                started_at=datetime.fromtimestamp(ended - 20, UTC),
                ended_at=datetime.fromtimestamp(ended, UTC),
                duration_seconds=20.0,
                iterations=100,
                stderr_tail="",
                steady_throughput=steady,
                peak_throughput=steady * 1.05,
                sustained_ratio=0.95,
                unit="FLOP/s",
                device_model=MODEL,
                stack_id=STACK,
                scope="device",
            )
        )


def _fleet_pass(engine: Engine) -> None:
    """On PostgreSQL, the fleet's pass a drift child makes once a period (the baselines are
    read by key from it, agent.archive.fleet_baselines); SQLite reads the peers' rows."""
    if fleet_baselines.present(engine):
        now = datetime.now(UTC)
        with engine.begin() as connection:
            fleet_baselines.refresh(connection, cutoff=now, since=now - timedelta(days=7))


def _run(device: ProbeDevice, outcome: str, steady: float | None, ended: float) -> ProbeRun:
    spec = ProbeSpec("matmul", "bf16", "eager", 20.0, device, size="large")
    return ProbeRun(
        uuid.uuid4().hex,
        spec,
        outcome,  # type: ignore[arg-type]
        "" if outcome == "ok" else "exit code 1: CUDA error: an illegal memory access",
        ended - 20,
        ended,
        manifest={"device_name": MODEL, "unit": "FLOP/s", "size": "large"},
    )


def _analysis(steady: float) -> RunAnalysis:
    figures = {"steady_throughput": steady, "sustained_ratio": 0.95}
    return RunAnalysis(figures, Attribution.from_dict({}))


def test_steady_throughput_under_identical_peers_is_degraded_with_their_median(
    archive_engine: Engine, tmp_path: Path
) -> None:
    now = time.time()
    for peer, steady in (("node-b", 99e12), ("node-c", 100e12), ("node-d", 101e12)):
        _seed(archive_engine, peer, _gpu(0), steady, now - 600)
    _fleet_pass(archive_engine)
    events: list[Event] = []
    monitor = HealthMonitor(
        HealthSection(),
        events.append,
        baseline=lambda identity, device, since: baseline(
            archive_engine, identity, "node-a", device, since
        ),
    )
    gpu = ProbeDevice("cuda", _gpu(7), "7", 7)
    for ended in (now - 300, now - 100):
        monitor.probe_run(_run(gpu, "ok", 85e12, ended), _analysis(85e12), STACK)
        _seed(archive_engine, "node-a", _gpu(7), 85e12, ended)
        if ended == now - 300:  # one run under the baseline is not yet a verdict
            assert {v.name: v.state for v in monitor.verdicts()}["GPU 7"] == "healthy"
    (verdict,) = [v for v in monitor.verdicts() if v.name == "GPU 7"]
    assert verdict.state == "degraded"
    (finding,) = verdict.findings
    assert finding.reason == "below_fleet_baseline"
    assert "15% under the peers' median 1e+14 FLOP/s (3 peers" in finding.evidence
    assert events[-1].kind == "health_change"
    assert dict(events[-1].attributes)["state"] == ("degraded")
    # A result back at the peers' level ends it.
    monitor.probe_run(_run(gpu, "ok", 100e12, now), _analysis(100e12), STACK)
    assert {v.name: v.state for v in monitor.verdicts()}["GPU 7"] == "healthy"

    # `sustain health` without the daemon computes the same from the archive.
    url = archive_engine.url.render_as_string(hide_password=False)
    config = tmp_path / "sustain.toml"
    config.write_text('[agent]\nnode = "node-a"\n')
    offline = _sustain("health", "--no-live", "--config", str(config), "--database", url, "--json")
    assert offline.returncode == 1, offline.stderr
    (device,) = json.loads(offline.stdout)["devices"]
    assert device["uuid"] == _gpu(7)
    assert device["state"] == "degraded"
    assert "median 1e+14" in device["reasons"][0]["evidence"]


def test_two_peers_make_no_baseline(archive_engine: Engine) -> None:
    now = time.time()
    for peer in ("node-b", "node-c"):
        _seed(archive_engine, peer, _gpu(0), 100e12, now - 600)
    _fleet_pass(archive_engine)
    monitor = HealthMonitor(
        HealthSection(),
        lambda event: None,
        baseline=lambda identity, device, since: baseline(
            archive_engine, identity, "node-a", device, since
        ),
    )
    gpu = ProbeDevice("cuda", _gpu(7), "7", 7)
    for ended in (now - 300, now - 100):
        monitor.probe_run(_run(gpu, "ok", 50e12, ended), _analysis(50e12), STACK)
    assert {v.name: v.state for v in monitor.verdicts()}["GPU 7"] == "healthy"


def test_repeated_probe_failures_make_the_device_unhealthy_until_a_run_succeeds() -> None:
    monitor = HealthMonitor(HealthSection(probe_failures=3), lambda event: None)
    now = time.time()
    for count in range(1, 4):
        monitor.probe_run(_run(CPU, "failed" if count % 2 else "timeout", None, now), None, None)
    (cpu,) = monitor.verdicts()
    assert cpu.state == "unhealthy"
    assert cpu.findings[0].reason == "probe_failures"
    assert "3 probe runs in a row failed or timed out" in cpu.findings[0].evidence
    monitor.probe_run(_run(CPU, "skipped", None, now), None, None)  # skips are not evidence
    assert monitor.verdicts()[0].state == "unhealthy"
    monitor.probe_run(_run(CPU, "ok", 1e9, now), _analysis(1e9), None)
    assert monitor.verdicts()[0].state == "healthy"


def test_low_node_coupling_degrades_the_device() -> None:
    coupling = Coupling(0.7, 7e12, 10e12, "steady", "thermal", "", low_runs=3)
    couplings = {("matmul", "bf16", "eager", "cpu", ""): coupling}
    monitor = HealthMonitor(HealthSection(), lambda event: None, couplings=lambda: couplings)
    monitor.probe_run(_run(CPU, "ok", 1e9, time.time()), _analysis(1e9), None)
    (cpu,) = monitor.verdicts()
    assert cpu.state == "degraded"
    assert cpu.findings[0].evidence.startswith("matmul bf16 node-wide at 70% of solo for 3 runs")
    couplings.clear()
    monitor.probe_run(_run(CPU, "ok", 1e9, time.time()), _analysis(1e9), None)
    assert monitor.verdicts()[0].state == "healthy"


def test_a_skipped_probe_names_the_slurm_job_that_held_the_gpu(
    scenario: Callable[[str, float], tuple[FakeGpus, NvmlCollector]], tmp_path: Path
) -> None:
    """Who was running is stored on probe skips: the job of the foreign process on the GPU."""
    archive = open_engine(f"sqlite:///{tmp_path}/archive.db")
    upgrade(archive)
    proc = tmp_path / "proc" / "4242"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text("0::/system.slice/slurmstepd.scope/job_777/step_0/user/task_0\n")
    fields = ["S", *["0"] * 18, "12345", *["0"] * 20]  # field 22 (start time) is 12345
    (proc / "stat").write_text(f"4242 (python3) {' '.join(fields)}\n")
    _, collector = scenario(FOREIGN, 1.0)
    store = TelemetryStore(64)
    occupancy = Occupancy(OccupancySection(), tmp_path / "proc")
    for sample in collector.collect():
        store.record(sample)
        occupancy.record(sample)
    scheduler = make_scheduler(archive, store=store)
    scheduler.occupants = lambda key: ", ".join(o.describe() for o in occupancy.occupants(key))
    gpu = scheduler.devices()[0]
    run = scheduler.run_one(ProbeSpec("matmul", "bf16", "eager", 0.5, gpu), command=child(OK))
    expected = "1 foreign compute process(es) on GPU 0 (held by slurm job 777)"
    assert (run.outcome, run.reason) == ("skipped", expected)
    assert archived(archive)[0] == ("skipped", expected, 0)
    archive.dispose()


def test_xids_since_boot_survive_an_agent_restart(archive_engine: Engine) -> None:
    """The daemon restores the XIDs the archive holds since boot; a clear after them holds."""
    writer = EventWriter(archive_engine, "node-a")
    now = time.time()
    writer.write([Event("xid", _gpu(1), now - 60, "GPU 1: XID 79", (("xid", "79"),))])
    writer.write([Event("xid", _gpu(2), now - 50, "GPU 2: XID 13", (("xid", "13"),))])
    monitor = HealthMonitor(HealthSection(), lambda event: None, cpu=False)
    monitor.restore(xids(archive_engine, "node-a", now - 3600), {})
    for index in (1, 2):
        labels = (("device", str(index)), ("uuid", _gpu(index)))
        monitor.record(Sample("nvml", _gpu(index), now, (Reading("gpu_healthy", 1.0, labels),)))
    states = {v.name: (v.state, [f.reason for f in v.findings]) for v in monitor.verdicts()}
    assert states == {"GPU 1": ("unhealthy", ["xid_79"]), "GPU 2": ("healthy", [])}
    # Before boot (the since argument): nothing to restore.
    assert xids(archive_engine, "node-a", now) == []
