"""Fail safe (issue 26): a device the node has never drops out of the verdict, missing or old
evidence is `unknown` (never healthy), and the cluster's tools never resume a node on it.

Unit tests drive ``HealthMonitor`` on its injectable clock and ``SamplerLoop`` with a collector
that blocks; the collector meets a GPU lost at start on the fake driver; the end-to-end tests run
the real agent on a fake driver whose every call hangs (``hang START END``), then the shipped
Slurm health check and node-problem-detector rule against it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import FakeGpus, Running, fetch, start_agent
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import insert
from test_daemon import STARTUP_SECONDS, quick_env
from test_health import _gpu, _sustain
from test_health_integrations import (
    HEALTHY_NODE,
    XID_NODE,
    SlurmNode,
    healthcheck_live,
    plain_env,
    run_as_npd,
    slurm_node,  # noqa: F401 - the fixture
)

from agent.archive.database import open_engine, upgrade
from agent.archive.models import EventRecord
from agent.config.health_section import HealthSection
from agent.config.settings import Settings
from agent.health.monitor import DeviceHealth, HealthMonitor, pci_gpus
from agent.health.records import recorded
from agent.telemetry.sampler import LoopStatus, SamplerLoop
from collectors.base import Event, Reading, Sample
from collectors.nvml.collector import NvmlCollector

T0 = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def _status(collector: str, *, stalled: bool = False, up: bool = True, **kw: Any) -> LoopStatus:
    return LoopStatus(
        collector=collector,
        interval_seconds=1.0,
        up=up,
        absent=kw.get("absent"),
        polls=kw.get("polls", 1),
        last_duration_seconds=None,
        last_lag_seconds=None,
        last_poll_timestamp=None,
        missed_polls=0,
        errors=kw.get("errors", {}),
        stalled=stalled,
    )


def _gpu_sample(index: int, at: float) -> Sample:
    labels = (("device", str(index)), ("uuid", _gpu(index)))
    return Sample("nvml", _gpu(index), at, (Reading("gpu_healthy", 1.0, labels),))


def _host(at: float) -> Sample:
    return Sample("host", "host", at, (Reading("cpu_utilization", 0.1, ()),))


def _monitor(
    clock: Clock, statuses: Sequence[LoopStatus] = (), **kw: Any
) -> tuple[HealthMonitor, list[Event]]:
    events: list[Event] = []
    settings = HealthSection(**kw.pop("settings", {}))
    monitor = HealthMonitor(settings, events.append, clock=clock, loops=lambda: statuses, **kw)
    return monitor, events


def _states(verdicts: Sequence[DeviceHealth]) -> dict[str, tuple[str, list[str]]]:
    return {v.name: (v.state, [f.reason for f in v.findings]) for v in verdicts}


def test_a_gpu_no_longer_sampled_stays_in_the_verdict_as_unknown() -> None:
    """Issue item 1: `verdicts()` dropped a device not sampled for 120 s; it is now unknown
    (not_sampled) with its age, recorded once as a health_change, and its XID still counts."""
    clock = Clock()
    monitor, events = _monitor(clock)
    xid = Event("xid", _gpu(1), T0, "GPU 1: XID 79", (("xid", "79"),))
    monitor.record(Sample("nvml", "system", T0, (), events=(xid,)))
    for index in (0, 1):
        monitor.record(_gpu_sample(index, T0))
    clock.now = T0 + 400  # NVML answers no more; the host collector goes on
    monitor.record(_host(clock.now))
    states = _states(monitor.verdicts())
    assert states["GPU 0"] == ("unknown", ["not_sampled"])
    assert states["GPU 1"] == ("unhealthy", ["not_sampled", "xid_79"])
    assert states["CPU"] == ("healthy", [])
    (gpu0,) = [v for v in monitor.verdicts() if v.name == "GPU 0"]
    assert "not sampled for 7 min" in gpu0.findings[0].evidence
    assert gpu0.evidence_at == T0
    recorded_states = [dict(e.attributes)["state"] for e in events if e.device == _gpu(0)]
    assert recorded_states == ["healthy", "unknown"]


def test_a_stalled_sampler_makes_its_devices_and_the_node_unknown() -> None:
    clock = Clock()
    statuses = [_status("nvml"), _status("host")]
    monitor, _ = _monitor(clock, statuses)
    monitor.record(_gpu_sample(0, T0))
    assert _states(monitor.verdicts()) == {"GPU 0": ("healthy", []), "CPU": ("healthy", [])}
    statuses[0] = _status("nvml", stalled=True, up=False)
    clock.now += 5
    monitor.record(_host(clock.now))
    states = _states(monitor.verdicts())
    assert states["GPU 0"] == ("unknown", ["sampler_stalled"])
    assert states["node"] == ("unknown", ["sampler_stalled"])
    assert states["CPU"] == ("healthy", [])


class _Blocking:
    """A collector whose first poll answers and every later one blocks (NVML hung)."""

    name = "nvml"

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}
        self.release = threading.Event()
        self.polls = 0

    def collect(self) -> Sequence[Sample]:
        self.polls += 1
        if self.polls > 1:
            self.release.wait(60)
        return ()


def _until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("the condition was not met in time")
        time.sleep(0.02)


def test_a_stalled_loop_reads_as_down_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    collector = _Blocking()
    loop = SamplerLoop(collector, 0.05, sinks=(), stall_seconds=0.3)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="agent.telemetry.sampler"):
        loop.start()
        try:
            _until(lambda: collector.polls > 1)
            _until(lambda: loop.status().stalled)
            for _ in range(5):
                status = loop.status()
                assert (status.stalled, status.up) == (True, False)
        finally:
            collector.release.set()
            loop.request_stop()
            loop.join(10)
    stalled = [r for r in caplog.records if "stalled" in r.getMessage()]
    assert len(stalled) == 1, caplog.text


def test_a_restart_while_a_gpu_is_lost_keeps_it_unhealthy_with_its_xid() -> None:
    """Issue item 1, the restart: GPU 1 (XID 79, lost) cannot be identified; the archive's
    devices and XID keep it in the verdict, labelled, unhealthy."""
    clock = Clock()
    known = [(_gpu(i), str(i), _gpu(i), f"GPU {i}") for i in (0, 1)]
    monitor, _ = _monitor(clock, [_status("nvml"), _status("host")], known=lambda: known)
    monitor.restore([(_gpu(1), T0 - 60, 79)], {})
    lost = Sample(
        "nvml",
        "gpu-index-1",
        T0,
        (Reading("gpu_healthy", 0.0, (("device", "1"), ("uuid", ""))),),
        ("device_lost",),
    )
    monitor.record(_gpu_sample(0, T0))
    monitor.record(lost)
    verdicts = {v.name: v for v in monitor.verdicts()}
    gpu1 = verdicts["GPU 1"]
    assert (gpu1.label, gpu1.uuid, gpu1.state) == ("1", _gpu(1), "unhealthy")
    assert [f.reason for f in gpu1.findings] == ["device_lost", "xid_79"]
    assert verdicts["GPU 0"].state == "healthy"
    # Identified again: the loss ends, the XID stays until cleared.
    clock.now += 10
    monitor.record(_gpu_sample(1, clock.now))
    assert _states(monitor.verdicts())["GPU 1"] == ("unhealthy", ["xid_79"])


def test_a_gpu_lost_at_start_is_looked_for_again_and_picked_up(
    scenario: Callable[[str, float], tuple[FakeGpus, NvmlCollector]],
) -> None:
    """Issue item 1: "skipped until restart". GPU 1 answers GPU_IS_LOST for the first 30 s of
    scenario (3 s real): sampled meanwhile as lost, then identified without a restart."""
    fake, collector = scenario("set time_scale 10\ndevice 0\ndevice 1\nfault 1 lost - - 30\n", 10.0)
    clock = Clock()
    monitor, _ = _monitor(clock, [_status("nvml")], cpu=False)
    first = collector.collect()
    assert [s.device for s in first if s.errors == ("device_lost",)] == ["gpu-index-1"]
    for sample in first:
        monitor.record(sample)
    assert _states(monitor.verdicts())["GPU 1"] == ("unhealthy", ["device_lost"])
    deadline = time.monotonic() + 120
    while _gpu(1) not in {s.device for s in collector.collect()}:
        assert time.monotonic() < deadline, "GPU 1 was never identified"
        time.sleep(0.2)
    clock.now += 1
    for sample in collector.collect():
        monitor.record(sample)
    assert _states(monitor.verdicts())["GPU 1"] == ("healthy", [])
    assert fake.scale == 10.0


def test_fewer_gpus_than_expected_make_the_node_unhealthy() -> None:
    clock = Clock()
    monitor, _ = _monitor(clock, [_status("nvml")], cpu=False, settings={"expected_gpus": 2})
    monitor.record(_gpu_sample(0, T0))
    states = _states(monitor.verdicts())
    assert states["node"] == ("unhealthy", ["gpus_missing"])
    (node,) = [v for v in monitor.verdicts() if v.name == "node"]
    assert "NVML identifies 1 of 2 GPUs" in node.findings[0].evidence
    monitor.record(_gpu_sample(1, T0))
    assert "node" not in _states(monitor.verdicts())


@pytest.mark.parametrize(
    "status",
    [
        _status("nvml", up=False, polls=0, absent="driver_not_loaded"),
        _status("nvml", up=False, polls=3, errors={"collect": 3}),
    ],
    ids=["driver_not_loaded", "init_fails"],
)
def test_nvml_failing_on_a_node_that_had_gpus_is_a_finding(status: LoopStatus) -> None:
    """Issue item 1: NVML init failing or the driver not loaded read `healthy: CPU`."""
    clock = Clock()
    known = [(_gpu(0), "0", _gpu(0), "GPU 0")]
    monitor, _ = _monitor(clock, [status, _status("host")], known=lambda: known)
    monitor.restore([], {})
    monitor.record(_host(T0))
    assert _states(monitor.verdicts())["node"] == ("unhealthy", ["nvml_unavailable"])
    # A node that never had a GPU: no driver here is not a fault.
    cpu_only, _ = _monitor(clock, [status, _status("host")])
    cpu_only.record(_host(T0))
    assert _states(cpu_only.verdicts()) == {"CPU": ("healthy", [])}


def test_gpus_on_the_pci_bus_are_expected(tmp_path: Path) -> None:
    devices = tmp_path / "bus" / "pci" / "devices"
    for address, vendor, kind in (
        ("0000:1b:00.0", "0x10de", "0x030200"),  # an H100: 3D controller
        ("0000:2a:00.0", "0x10de", "0x030000"),  # VGA
        ("0000:3c:00.0", "0x10de", "0x068000"),  # an NVSwitch: not a GPU
        ("0000:00:1f.0", "0x8086", "0x030000"),  # another vendor's display
    ):
        (devices / address).mkdir(parents=True)
        (devices / address / "vendor").write_text(vendor + "\n")
        (devices / address / "class").write_text(kind + "\n")
    found = pci_gpus(tmp_path)
    assert found == ("0000:1b:00.0", "0000:2a:00.0")
    monitor, _ = _monitor(Clock(), [_status("nvml")], cpu=False, pci_gpus=found)
    monitor.record(_gpu_sample(0, T0))
    assert _states(monitor.verdicts())["node"] == ("unhealthy", ["gpus_missing"])


# -- the archive: evidence age and sequence ------------------------------------------------------


def _archive(data: Path) -> tuple[Any, str]:
    engine = open_engine(f"sqlite:///{data / 'sustain.db'}")
    upgrade(engine)
    return engine, Settings(agent={"data_dir": data}).agent.node


def _verdict_row(node: str, device: str, state: str, at: datetime, label: str) -> dict[str, Any]:
    attributes = {"state": state, "device": label, "uuid": device, "name": f"GPU {label}"}
    return {
        "event_id": f"{device[-4:]}{state}{at.timestamp():.0f}"[:32],
        "node": node,
        "device": device,
        "kind": "health_change",
        "occurred_at": at,
        "message": "",
        "attributes": json.dumps({**attributes, "findings": "[]"}),
    }


def test_an_archived_verdict_older_than_the_limit_is_unknown_with_its_age(tmp_path: Path) -> None:
    """Issue item 2: the agent stopped, its verdicts 30 days old: `healthy`, exit 0 before."""
    engine, node = _archive(tmp_path)
    month_ago = datetime.now(UTC) - timedelta(days=30)
    with engine.begin() as connection:
        for index in (0, 1):
            row = _verdict_row(node, _gpu(index), "healthy", month_ago, str(index))
            connection.execute(insert(EventRecord).values(**row))
    engine.dispose()
    flags = ["--data-dir", str(tmp_path), "--no-live"]
    result = _sustain("health", "--summary", *flags)
    assert result.returncode == 2, result
    assert result.stdout.startswith("unknown: GPU 0"), result.stdout
    assert result.stdout.rstrip().endswith("(archive, 30 d old)"), result.stdout
    verdict = json.loads(_sustain("health", "--json", *flags).stdout)
    assert verdict["state"] == "unknown"
    assert verdict["evidence_age_seconds"] > 29 * 86_400
    reasons = {d["name"]: [r["reason"] for r in d["reasons"]] for d in verdict["devices"]}
    assert reasons == {"GPU 0": ["stale_evidence"], "GPU 1": ["stale_evidence"]}


def test_the_last_written_verdict_wins_over_a_later_clock(tmp_path: Path) -> None:
    """Issue item 2: `max(occurred_at)` let an older verdict win after the clock stepped back."""
    engine, node = _archive(tmp_path)
    now = datetime.now(UTC)
    with engine.begin() as connection:
        for state, at in (("unhealthy", now), ("healthy", now - timedelta(hours=1))):
            connection.execute(
                insert(EventRecord).values(**_verdict_row(node, _gpu(0), state, at, "0"))
            )
    assert recorded(engine, node)[_gpu(0)].state == "healthy"
    engine.dispose()


# -- end to end: the agent's NVML hangs -----------------------------------------------------------

HANG_CONFIG = """
[probing]
enabled = false
[sampler]
stall_seconds = 2
[health]
hold_seconds = 1
"""


@pytest.fixture
def hung_node(fake_nvml: Path, tmp_path: Path) -> Iterator[Callable[[str], Running]]:
    """`sustain run` on a scenario whose NVML hangs from scenario second 6 on."""
    agents: list[Running] = []

    def start(scenario: str) -> Running:
        directory = tmp_path / f"hung{len(agents)}"
        directory.mkdir()
        (directory / "node.scn").write_text(scenario + "hang 6 -\n")
        (directory / "sustain.toml").write_text(HANG_CONFIG)
        env = quick_env(
            directory,
            LD_LIBRARY_PATH=str(fake_nvml.parent),
            FAKENVML_SCENARIO=str(directory / "node.scn"),
        )
        agents.append(start_agent(directory, "--config", str(directory / "sustain.toml"), env=env))
        return agents[-1]

    yield start
    for agent in agents:
        if agent.process.poll() is None:
            agent.process.kill()
            agent.process.communicate()


def _stalled(agent: Running) -> dict[str, float]:
    """Wait for the nvml loop to stall; the nvml series of /metrics then."""
    agent.wait_for('sustain_device_health{device="1"', timeout=STARTUP_SECONDS)
    deadline = time.monotonic() + 120
    while True:
        _, body = fetch(agent.base + "/metrics")
        found = {
            f"{s.name}{sorted(s.labels.items())}": s.value
            for family in text_string_to_metric_families(body)
            for s in family.samples
        }
        if found.get("sustain_sampler_stalled[('collector', 'nvml')]") == 1:
            return found
        assert time.monotonic() < deadline, "the nvml loop never stalled"
        time.sleep(0.3)


@pytest.mark.slow
def test_hung_nvml_after_an_xid_never_reads_healthy_nor_resumes(
    hung_node: Callable[[str], Running],
    slurm_node: SlurmNode,  # noqa: F811
) -> None:
    agent = hung_node(XID_NODE)
    agent.wait_for('reason="xid_79"', timeout=STARTUP_SECONDS)
    found = _stalled(agent)
    assert found["sustain_collector_up[('collector', 'nvml')]"] == 0
    metrics = ["--metrics", f"{agent.base}/metrics", "--data-dir", str(agent.data_dir)]
    result = _sustain("health", "--summary", *metrics)
    assert result.returncode == 1, result
    assert result.stdout.startswith("unhealthy: GPU 1 xid_79"), result.stdout
    assert "unknown" in result.stdout, result.stdout

    slurm_node.show("IDLE+DRAIN", "sustain: unhealthy: GPU 1 xid_79 [root@2026-01-05]")
    healthcheck_live(slurm_node, agent)
    assert all("State=RESUME" not in update for update in slurm_node.updates())
    assert run_as_npd(f"{agent.base}/metrics", plain_env()).status == "NonOK"


@pytest.mark.slow
def test_hung_nvml_on_a_drained_node_is_unknown_and_never_resumes(
    hung_node: Callable[[str], Running],
    slurm_node: SlurmNode,  # noqa: F811
) -> None:
    """Without an XID the hung node read `healthy` (exit 0) and the health check resumed it."""
    agent = hung_node(HEALTHY_NODE)
    _stalled(agent)
    result = _sustain("health", "--summary", "--metrics", f"{agent.base}/metrics")
    assert result.returncode == 2, result
    assert result.stdout.startswith("unknown: "), result.stdout
    slurm_node.show("IDLE+DRAIN", "sustain: unhealthy: GPU 1 xid_79 [root@2026-01-05]")
    healthcheck_live(slurm_node, agent)
    assert slurm_node.updates() == []
    assert "no verdict" in slurm_node.syslog()
    assert run_as_npd(f"{agent.base}/metrics", plain_env()).status == "Unknown"
