"""The exposition: the golden file for host telemetry, the metrics catalogue in docs/metrics.md,
and /healthz over a real socket."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import FakeGpus
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.process_collector import ProcessCollector
from test_dashboards import promtool
from test_names import same_as_golden

from agent.archive.database import open_engine, upgrade
from agent.archive.job import ArchiveJob
from agent.archive.sink import ArchiveSink
from agent.archive.spool import Spool
from agent.config.settings import DriftSection, ProbingSection
from agent.drift.job import DriftJob
from agent.exporter.metrics import AgentMetrics
from agent.exporter.server import ExporterApp, ExporterServer
from agent.exporter.text import Encoder, _Fixed
from agent.health.monitor import DeviceHealth
from agent.health.rules import Finding
from agent.occupancy.tracker import OccupancyStatus
from agent.probes.analysis import RunAnalysis
from agent.probes.attribution import Attribution
from agent.probes.devices import TelemetryCapture
from agent.probes.runner import ProbeRunner
from agent.probes.scheduler import ProbeScheduler
from agent.probes.status import ProbeResult, ProbeStatus
from agent.stack.tracker import StackTracker
from agent.telemetry.rollup import RollupBuilder
from agent.telemetry.sampler import SamplerLoop
from agent.telemetry.store import TelemetryStore
from collectors.host import HostCollector
from collectors.nvml.collector import NvmlCollector

ROOT = Path(__file__).parent.parent
FIXTURE = Path(__file__).parent / "fixtures" / "host"
SCENARIOS = Path(__file__).parent / "fakenvml" / "scenarios"
GOLDEN = Path(__file__).parent / "golden" / "host.prom"
SELF_PREFIXES = (
    "sustain_collector_",
    "sustain_sampler_",
    "sustain_rollup_",
    "sustain_process_",
    "sustain_events_",
    "sustain_archive_",
    "sustain_probe_",
    "sustain_stack_",
    "sustain_drift_",
    "sustain_build_info",
    "sustain_device_pod_info",
    "sustain_device_health",
    "sustain_podresources_",
)


def advance_stat(proc: Path) -> None:
    """Add busy and idle jiffies to every cpu line of a copied /proc/stat (1/4 busy)."""
    lines = []
    for line in (proc / "stat").read_text().splitlines():
        if line.startswith("cpu"):
            name, *columns = line.split()
            numbers = [int(column) for column in columns]
            numbers[0] += 100  # user
            numbers[3] += 300  # idle
            lines.append(" ".join([name, *map(str, numbers)]))
        else:
            lines.append(line)
    (proc / "stat").write_text("\n".join(lines) + "\n")


@pytest.fixture
def host_tree(tmp_path: Path) -> Path:
    tree = tmp_path / "host"
    shutil.copytree(FIXTURE, tree)
    return tree


# What `python -m agent.drift.detect` answers (its shape is tested in tests/test_drift.py).
DRIFT_ANSWER = {
    "drifts": [
        {
            "node": "node-a",
            "device": "GPU-0",
            "device_label": "0",
            "workload": "matmul",
            "precision": "bf16",
            "optimization": "eager",
            "at": "2026-11-20T10:00:00+00:00",
            "before": 100.0,
            "after": 92.0,
            "change": -0.08,
            "pvalue": 1e-9,
            "direction": "regression",
            "cause": "stack",
            "explanation": "driver.version 550.54.15 -> 555.42.02",
            "run_id": "r" * 32,
            "stack_before": "a" * 64,
            "stack_after": "b" * 64,
            "event_id": "e" * 32,
        }
    ],
    "outliers": [
        {
            "node": "node-a",
            "device": "GPU-0",
            "device_label": "0",
            "workload": "matmul",
            "precision": "bf16",
            "optimization": "eager",
            "ratio": 0.85,
            "outlier": True,
        }
    ],
}


# What the kubelet's PodResources API named (its client is tested in tests/test_occupancy.py).
OCCUPANCY = OccupancyStatus(
    pods=[("0", "GPU-0", "ml", "train-0", "main")], requests={"ok": 3}, last_success=1.7e9
)

HEALTH = [
    DeviceHealth(
        "GPU-0",
        "0",
        "GPU-0",
        "GPU 0",
        "degraded",
        (Finding("pcie_link_degraded", "degraded", "PCIe gen 3 x16 on a gen 5 x16 link", 1.7e9),),
        (Finding("xid_79", "unhealthy", "XID 79", 1.7e9),),
    )
]


@pytest.fixture
def exposition_parts(
    host_tree: Path, tmp_path: Path
) -> Iterator[tuple[CollectorRegistry, SamplerLoop, ArchiveJob]]:
    """The host collector on the fixture tree, through the agent's sinks to a real archive."""
    collector = HostCollector(procfs=host_tree / "proc", sysfs=host_tree / "sys")
    store = TelemetryStore(64)
    builder = RollupBuilder({"host": dict(collector.fields)}, 10, started_at=0.0)
    loop = SamplerLoop(collector, 1.0, sinks=(store.record, builder.add), stall_seconds=30)
    loop.poll_once()
    advance_stat(host_tree / "proc")
    energy = host_tree / "sys" / "class" / "powercap" / "intel-rapl:0" / "energy_uj"
    energy.write_text(str(int(energy.read_text()) + 5_000_000) + "\n")
    time.sleep(0.05)
    loop.poll_once()

    engine = open_engine(f"sqlite:///{tmp_path}/archive.db")
    upgrade(engine)
    job = ArchiveJob(
        builder, ArchiveSink(engine, "node-a", Spool(tmp_path / "spool.db")), retention_days=1
    )
    job.run(now=time.time() + 20)  # close the period the two polls fell in
    assert job.sink.drain()
    registry = CollectorRegistry(auto_describe=False)
    probes = ProbeScheduler(
        ProbingSection(), ProbeRunner(), store, TelemetryCapture(), (loop,), 1.0
    )
    stacks = StackTracker(job.sink, nvml=None, python=sys.executable)
    stacks.refresh()  # torch facts from a real `python -m workloads facts` child
    drift = DriftJob(DriftSection(), "sqlite://", "node-a", job.sink)
    drift.take(DRIFT_ANSWER)
    registry.register(
        AgentMetrics(
            store,
            {"host": dict(collector.fields)},
            lambda: [loop.status()],
            15.0,
            archive=job.status,
            probes=probes.status,
            stack=stacks.status,
            drift=drift.status,
            occupancy=lambda: OCCUPANCY,
            health=lambda: HEALTH,
        )
    )
    ProcessCollector(namespace="sustain", registry=registry)
    yield registry, loop, job
    engine.dispose()


def host_lines(text: str) -> str:
    kept = []
    for line in text.splitlines():
        name = line.split()[2] if line.startswith("#") else line
        if not name.startswith(SELF_PREFIXES):
            kept.append(line)
    return "\n".join(kept) + "\n"


def test_host_exposition_matches_golden_file(
    exposition_parts: tuple[CollectorRegistry, SamplerLoop, ArchiveJob],
) -> None:
    registry, _, _ = exposition_parts
    text = host_lines(generate_latest(registry).decode())
    if os.environ.get("SUSTAIN_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def catalogue() -> dict[str, tuple[str, tuple[str, ...]]]:
    """name -> (type, labels) from the tables of docs/metrics.md."""
    entries = {}
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if len(cells) < 4 or not re.fullmatch(r"`sustain_[a-z0-9_]+`", cells[0]):
            continue
        labels = tuple(sorted(part.strip() for part in cells[3].split(",") if part.strip()))
        entries[cells[0].strip("`")] = (cells[1], labels)
    return entries


def gpu_exposition(scenario: Callable[[str, float], tuple[FakeGpus, NvmlCollector]]) -> str:
    """The GPU families: the fake driver's scenario that sets every field, then the node with a
    MIG GPU and the GPUs' CPU affinity (one NVML init at a time); GPM needs two polls."""
    return "".join(gpu_expositions(scenario))


def gpu_expositions(
    scenario: Callable[[str, float], tuple[FakeGpus, NvmlCollector]],
) -> list[str]:
    """``gpu_exposition``, one exposition per scenario."""
    texts = []
    for name in ("every_field.scn", "mig_node.scn"):
        fake, gpus = scenario((SCENARIOS / name).read_text(), 1.0)
        store = TelemetryStore(64)
        loop = SamplerLoop(gpus, 1.0, sinks=(store.record,), stall_seconds=30)
        loop.poll_once()
        fake.sleep_until(0.6)  # every_field.scn: the XID at 0.2 s is in by then
        loop.poll_once()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(AgentMetrics(store, {"nvml": dict(gpus.fields)}, lambda: [], 15.0))
        texts.append(generate_latest(registry).decode())
        gpus.close()
    return texts


def probe_exposition() -> str:
    """The probe families with one result of each unit (matmul, membw, inference)."""
    status = ProbeStatus(runs={}, last_run={}, running={}, duty_used={}, results={})
    for workload, unit, work_unit in (
        ("matmul", "FLOP/s", "flop"),
        ("membw", "B/s", "byte"),
        ("inference", "tokens/s", "token"),
    ):
        figures = {
            "peak_throughput": 2.0,
            "steady_throughput": 1.5,
            "p10_throughput": 1.4,
            "p50_throughput": 1.5,
            "sustained_ratio": 0.75,
            "classification": "slowdown",
        }
        attribution = Attribution((), "thermal", 1e9, "")
        status.results[(workload, "fp32", "eager", "0", "GPU-0")] = ProbeResult(
            unit, work_unit, RunAnalysis(figures, attribution)
        )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentMetrics(TelemetryStore(4), {}, lambda: [], 15.0, probes=lambda: status))
    return generate_latest(registry).decode()


def test_no_family_mixes_units_and_promtool_finds_no_problem(
    exposition_parts: tuple[CollectorRegistry, SamplerLoop, ArchiveJob],
    scenario: Callable[[str, float], tuple[FakeGpus, NvmlCollector]],
) -> None:
    """Issue 17, acceptance 3: one family per unit (no label saying the unit), and `promtool
    check metrics` (the Prometheus naming and exposition lint) reports nothing."""
    registry, _, _ = exposition_parts
    texts = [generate_latest(registry).decode(), *gpu_expositions(scenario), probe_exposition()]
    throughput = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            labels = {label for sample in family.samples for label in sample.labels}
            assert not labels & {"unit", "work_unit"}, family.name
            if family.name.startswith("sustain_probe_") and family.samples:
                throughput[family.name] = {s.labels.get("workload") for s in family.samples}
        result = subprocess.run(
            [promtool(), "check", "metrics"],
            input=text,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.strip() == "", result.stdout
    assert throughput["sustain_probe_flops"] == {"matmul"}
    assert throughput["sustain_probe_bytes_per_second"] == {"membw"}
    assert throughput["sustain_probe_tokens_per_second"] == {"inference"}
    assert throughput["sustain_probe_tokens_per_joule"] == {"inference"}


def test_catalogue_and_exposition_agree(
    exposition_parts: tuple[CollectorRegistry, SamplerLoop, ArchiveJob],
    scenario: Callable[[str, float], tuple[FakeGpus, NvmlCollector]],
) -> None:
    """Host families from the fixture tree, GPU families from the fake driver's scenario that
    sets every field, self-metrics from the agent: together every family there is."""
    registry, _, job = exposition_parts
    assert job.status().rows_written > 0
    text = generate_latest(registry).decode() + gpu_exposition(scenario)
    exposed: dict[str, tuple[str, tuple[str, ...]]] = {}
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        seen = {label for sample in family.samples for label in sample.labels}
        exposed[name] = (family.type, tuple(sorted(seen)))
    documented = catalogue()
    assert sorted(set(exposed) - set(documented)) == [], "exposed but not in docs/metrics.md"
    assert sorted(set(documented) - set(exposed)) == [], "in docs/metrics.md but not exposed"
    for name, (kind, labels) in documented.items():
        assert exposed[name][0] == kind, name
        # A family with no series yet (no errors so far) shows no labels to compare.
        if exposed[name][1]:
            assert exposed[name][1] == labels, name


def test_an_absent_collector_exports_why_and_no_up_series(
    fake_nvml: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collector whose source is not installed (the fake library without a scenario answers
    as a driver that is not loaded) has no sustain_collector_up series, as node_exporter exports
    nothing for a collector that does not apply; sustain_collector_absent says why, with the
    labels of the catalogue, and nothing is counted as an error."""
    monkeypatch.delenv("FAKENVML_SCENARIO", raising=False)
    gpus = NvmlCollector()
    loop = SamplerLoop(gpus, 1.0, sinks=(), stall_seconds=30)
    try:
        loop.poll_once()
        loop.poll_once()
    finally:
        gpus.close()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        AgentMetrics(TelemetryStore(8), {"nvml": dict(gpus.fields)}, lambda: [loop.status()], 15)
    )
    exposed = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }
    absent = {key: value for key, value in exposed.items() if key[0] == "sustain_collector_absent"}
    assert absent == {
        ("sustain_collector_absent", (("collector", "nvml"), ("reason", "driver_not_loaded"))): 1
    }
    assert catalogue()["sustain_collector_absent"] == ("gauge", ("collector", "reason"))
    assert not [key for key in exposed if key[0] == "sustain_collector_up"]
    assert not [key for key in exposed if key[0] == "sustain_collector_errors_total"]
    assert exposed[("sustain_collector_polls_total", (("collector", "nvml"),))] == 2


def test_healthz_turns_503_when_a_loop_stalls(
    exposition_parts: tuple[CollectorRegistry, SamplerLoop, ArchiveJob],
) -> None:
    registry, loop, _ = exposition_parts
    loop.stall_seconds = 0.2
    loop.interval_seconds = 0.05
    server = ExporterServer("127.0.0.1", 0, ExporterApp(registry, lambda: [loop.status()]))
    server.start()
    try:
        loop.poll_once()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz") as response:
            assert response.status == 200
        time.sleep(0.3)  # no poll for longer than the stall time
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz")
        assert raised.value.code == 503
        assert raised.value.read() == b"stalled: host\n"
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics") as response:
            assert b'sustain_sampler_stalled{collector="host"} 1.0' in response.read()
    finally:
        server.stop()


def test_metric_families_are_unchanged(
    exposition_parts: tuple[CollectorRegistry, SamplerLoop, ArchiveJob],
    scenario: Callable[[str, float], tuple[FakeGpus, NvmlCollector]],
) -> None:
    """Host, self and GPU families (the fake driver's scenario that sets every field)."""
    registry, _, _ = exposition_parts
    text = generate_latest(registry).decode() + gpu_exposition(scenario)
    families: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        name = f"{family.name} {family.type}"
        labels = families.setdefault(name, set())
        labels.update(label for sample in family.samples for label in sample.labels)
    lines = [
        f"{name} {','.join(sorted(labels))}".rstrip() for name, labels in sorted(families.items())
    ]
    same_as_golden("metric-families.txt", "\n".join(lines) + "\n")


def test_fast_encoder_writes_what_prometheus_client_writes(
    exposition_parts: tuple[CollectorRegistry, SamplerLoop, ArchiveJob],
    scenario: Callable[[str, float], tuple[FakeGpus, NvmlCollector]],
) -> None:
    """/metrics renders through agent.exporter.text (issue 17: p99 <= 10 ms with 8 GPUs): byte
    for byte what prometheus_client's encoders write, in both formats, including label values
    that need escaping; a family it does not render goes through prometheus_client whole."""
    registry, _, _ = exposition_parts
    hostile = GaugeMetricFamily("sustain_test_escape", 'a "help"\\ line\nend', labels=["x"])
    hostile.add_metric(['quote " backslash \\ newline \n'], 1.5)
    summary = SummaryMetricFamily("sustain_test_summary", "a summary", count_value=2, sum_value=3)
    for metrics in (
        list(registry.collect()),
        [*registry.collect(), hostile],
        [hostile, summary],  # the fallback
    ):
        fixed = _Fixed(metrics)
        for content_type, reference in (
            ("text/plain; version=0.0.4; charset=utf-8", generate_latest),
            ("application/openmetrics-text; version=1.0.0; charset=utf-8", generate_openmetrics),
        ):
            assert Encoder().render(fixed, content_type) == reference(fixed)
