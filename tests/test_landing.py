"""The landing page at /: the node, its collectors, each device's health verdict and latest probe
run (its own outcome and figures, never an older run's), and the links, from a real agent on the
fake NVML driver (probes on the fake GPUs run through the CPU wrapper interpreter) and on a node
without NVML; hostile names are escaped.
"""

from __future__ import annotations

import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import Running, cpu_wrapper, fetch, start_agent
from test_probes import SPEC, child

from agent.config.settings import ProbingSection
from agent.exporter.landing import LandingSources, render
from agent.health.monitor import DeviceHealth
from agent.health.rules import Finding
from agent.probes.analysis import RunAnalysis
from agent.probes.attribution import Attribution
from agent.probes.devices import TelemetryCapture
from agent.probes.runner import ProbeRunner
from agent.probes.scheduler import ProbeScheduler
from agent.probes.status import LatestRun, ProbeResult, ProbeStatus
from agent.telemetry.sampler import LoopStatus
from agent.telemetry.store import TelemetryStore

HOSTILE = "<script>alert(1)</script>"
UUID0 = "GPU-1a2b0000-0000-4000-8000-000000000000"
UUID1 = "GPU-1a2b0000-0000-4000-8000-000000000001"
SCENARIO = f"""
set time_scale 1
device 0 name "{HOSTILE}" uuid {UUID0} pci_bus_id 00000000:18:00.0
device 1 name "NVIDIA H100 80GB HBM3" uuid {UUID1} pci_bus_id 00000000:2A:00.0
at 0 0 gpu_util_pct 0 reasons 0x1
at 0 1 gpu_util_pct 0 reasons 0x1
xid 1 1 79
"""
DOCS = "https://docs.example/sustain/docs"


def _page(running: Running, needles: tuple[str, ...], timeout: float) -> str:
    """The landing page once it holds every needle."""
    deadline = time.monotonic() + timeout
    for needle in needles:
        running.wait_for(needle, max(1.0, deadline - time.monotonic()), path="/")
    return fetch(running.base + "/")[1]


def _row(page: str, cell: str) -> str:
    """The table row whose first cell is ``cell``."""
    start = page.index(f"<tr><td>{cell}</td>")
    return page[start : page.index("</tr>", start)]


@pytest.mark.slow
def test_the_page_of_a_gpu_node_with_a_probe(fake_nvml: Path, tmp_path: Path) -> None:
    (tmp_path / "node.scn").write_text(SCENARIO)
    wrapper, _ = cpu_wrapper(tmp_path)
    # 4 s of the small matmul: thousands of iterations however loaded the machine is, and four
    # whole one-second windows, so the page has a steady figure or a p10 to show.
    config = tmp_path / "sustain.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [agent]
            node = "landing-node"
            [exporter]
            docs_url = "{DOCS}/"
            [health]
            hold_seconds = 1
            [probing]
            initial_delay_seconds = 0
            duty_cycle = 1.0
            busy_gpu_utilization = 1.0
            busy_cpu_utilization = 1.0
            preempt = false
            python = "{wrapper}"
            [[probing.plan]]
            workload = "matmul"
            precisions = ["fp32"]
            duration_seconds = 4
            size = "small"
            interval_seconds = 3600
            jitter_seconds = 0
            """
        )
    )
    running = start_agent(
        tmp_path / "data",
        "--config",
        str(config),
        env={
            "LD_LIBRARY_PATH": str(fake_nvml.parent),
            "FAKENVML_SCENARIO": str(tmp_path / "node.scn"),
        },
    )
    try:
        page = _page(running, ("xid_79", "matmul fp32 eager", "<td>ok</td>"), timeout=150)
        with urllib.request.urlopen(running.base + "/", timeout=5) as response:
            headers = response.headers
    finally:
        code, _, err = running.terminate()
    assert code == 0, err

    assert headers["Content-Type"] == "text/html; charset=utf-8"
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert "<h1>sustain " in page
    assert " on landing-node</h1>" in page
    # The hostile device name is text, not markup.
    assert HOSTILE not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page, page
    assert "<script" not in page.lower()
    # Collectors: both up.
    assert "<td class=up>up</td>" in _row(page, "nvml")
    assert "<td class=up>up</td>" in _row(page, "host")
    # Devices: GPU 1 unhealthy with its reason and evidence, GPU 0 and the CPU healthy.
    gpu1 = _row(page, "1")
    assert UUID1 in gpu1
    assert "<td class=unhealthy>unhealthy<ul><li>xid_79: " in gpu1
    assert "GPU has fallen off the bus" in gpu1 or "79" in gpu1
    gpu0 = _row(page, "0")
    assert UUID0 in gpu0
    assert "<td class=healthy>healthy" in gpu0
    assert "<td class=healthy>healthy" in _row(page, "cpu")
    # The latest probe of a GPU that was probed: workload, its outcome, its throughput on its
    # basis, its sustained ratio, classification.
    probed = [row for row in (gpu0, gpu1) if "matmul fp32 eager" in row]
    assert probed, page
    cells = [cell.removesuffix("</td>") for cell in probed[0].split("<td>")]
    outcome, figure, ratio, classification = cells[-4:]
    assert outcome == "ok"
    assert figure.endswith(("FLOP/s steady", "FLOP/s p10 (no steady state)")), figure
    assert ratio == "" or 0.0 < float(ratio) <= 1.5
    assert classification.split(" ")[0] in ("flat", "warmup", "slowdown", "no_steady_state")
    # Links.
    assert '<a href="/metrics">' in page
    assert '<a href="/healthz">' in page
    assert f'<a href="{DOCS}/health.md">' in page
    assert f'<a href="{DOCS}/metrics.md">' in page


@pytest.mark.slow
def test_the_page_of_a_cpu_only_node_says_why_nvml_is_absent(tmp_path: Path) -> None:
    config = tmp_path / "sustain.toml"
    config.write_text("[probing]\nenabled = false\n[health]\nenabled = false\n")
    running = start_agent(tmp_path / "data", "--config", str(config))
    try:
        page = _page(running, ("<td>nvml</td>", "<td>host</td>"), timeout=120)
    finally:
        code, _, err = running.terminate()
    assert code == 0, err
    nvml = _row(page, "nvml")
    assert "<td class=absent>absent</td>" in nvml
    assert "library_not_found: no libnvidia-ml.so.1" in nvml or "kernel driver" in nvml, nvml
    assert "Health verdicts are off (health.enabled)." in page
    assert "docs/health.md" in page
    assert "exporter.docs_url" in page
    assert '<a href="/metrics">' in page


def test_every_value_is_escaped() -> None:
    """Names, evidence, node and docs URL are escaped; nothing turns into markup."""
    finding = Finding("xid_79", "unhealthy", "XID 79 <b>bold</b> & 'quoted'", 1.0)
    device = DeviceHealth("GPU-x", "0", 'GPU-"x"', HOSTILE, "unhealthy", (finding,))
    loop = LoopStatus("nvml<i>", 1.0, False, "no <driver>", 0, None, None, None, 0, {}, False)
    key = ("matmul<", "fp32", "eager", "0", 'GPU-"x"')
    analysis = RunAnalysis(
        {"sustained_ratio": 0.875, "classification": "slowdown<", "steady_throughput": 7e14},
        Attribution((), "thermal&", None, ""),
    )
    result = ProbeResult("FLOP/s<", "flop", analysis)
    status = ProbeStatus(
        {},
        {key: 100.0},
        {},
        {},
        {key: result},
        latest={key: LatestRun("ok", "", 90.0, 100.0, result)},
    )
    page = render(
        LandingSources(
            '"><img src=x>',
            lambda: [loop],
            lambda: [device],
            lambda: status,
            docs_url='https://docs.example/"<x>',
        ),
        now=130.0,
    ).decode()
    for raw in (HOSTILE, "<b>", "<i>", "<driver>", "<img", '"x"', "slowdown<", "thermal&)", "<x>"):
        assert raw not in page, raw
    assert "XID 79 &lt;b&gt;bold&lt;/b&gt; &amp; &#x27;quoted&#x27;" in page
    assert "<td>0.875</td><td>slowdown&lt; (thermal&amp;)</td>" in page
    assert "<td>ok</td><td>700.0 TFLOP/s&lt; steady</td>" in page
    assert "<td>30 s ago</td>" in page
    assert "<td class=absent>absent</td>" in page
    assert "no &lt;driver&gt;" in page


ANALYSED = ProbeResult(
    "FLOP/s",
    "flop",
    RunAnalysis(
        {"sustained_ratio": 0.875, "classification": "flat", "steady_throughput": 5.2e13},
        Attribution((), None, None, ""),
    ),
)


def probe_status(**latest: LatestRun) -> ProbeStatus:
    """A node whose GPU 0 had an analysed matmul run (``ANALYSED``, the one the gauges hold),
    and whose latest run of each probe is ``latest``'s (by workload)."""
    keys = {workload: (workload, "fp32", "eager", "0", UUID0) for workload in ("matmul", *latest)}
    return ProbeStatus(
        {},
        {keys[workload]: run.ended_at for workload, run in latest.items()},
        {},
        {},
        {keys["matmul"]: ANALYSED},
        latest={keys[workload]: run for workload, run in latest.items()},
    )


def gpu0_row(status: ProbeStatus, now: float) -> str:
    device = DeviceHealth(UUID0, "0", "NVIDIA H100 80GB HBM3", UUID0, "healthy", ())
    page = render(LandingSources("node", list, lambda: [device], lambda: status), now=now).decode()
    return _row(page, "0")


def test_a_latest_run_that_gave_no_figures_says_so_never_beside_older_figures() -> None:
    """Issue 23: the latest run timed out an hour after the analysed one the gauges still hold.
    The page shows the timeout, its own time, and why there are no figures: not the older
    run's sustained ratio and classification."""
    timeout = LatestRun(
        "timeout",
        "insufficient: 1 iteration of 53 s in 60 s; at least 30 are needed",
        3640.0,
        3700.0,
    )
    row = gpu0_row(probe_status(matmul=timeout), now=3730.0)
    assert "<td>matmul fp32 eager</td><td>30 s ago</td>" in row
    assert (
        "<td>timeout after 60 s, no figures: insufficient: 1 iteration of 53 s in 60 s; at least "
        "30 are needed</td><td></td><td></td><td></td>"
    ) in row
    assert "0.875" not in row
    assert "flat" not in row
    # The older analysed run, had it been the latest, with its own time and figures.
    row = gpu0_row(probe_status(matmul=LatestRun("ok", "", 40.0, 100.0, ANALYSED)), now=130.0)
    assert (
        "<td>matmul fp32 eager</td><td>30 s ago</td><td>ok</td><td>52.00 TFLOP/s steady</td>"
        "<td>0.875</td><td>flat</td>"
    ) in row


def test_the_latest_of_the_devices_probes_is_the_one_shown() -> None:
    """A device probed with two workloads shows the run that ended last, whichever it was; a
    run that never settled shows its p10, marked so."""
    unsettled = RunAnalysis(
        {"classification": "no_steady_state", "p10_throughput": 4.6e13, "sustained_ratio": None},
        Attribution((), None, None, ""),
    )
    membw = LatestRun("ok", "", 150.0, 200.0, ProbeResult("FLOP/s", "flop", unsettled))
    failed = LatestRun("failed", "exit 1: CUDA error", 100.0, 103.0)
    row = gpu0_row(probe_status(membw=membw, attention=failed), now=230.0)
    assert (
        "<td>membw fp32 eager</td><td>30 s ago</td><td>ok</td>"
        "<td>46.00 TFLOP/s p10 (no steady state)</td><td></td><td>no_steady_state</td>"
    ) in row
    row = gpu0_row(probe_status(attention=LatestRun("failed", "exit 1", 300.0, 303.0)), 330.0)
    assert "<td>failed after 3 s, no figures: exit 1</td>" in row
    no_run = gpu0_row(probe_status(), now=10.0)
    assert "<td colspan=6>no probe run yet</td>" in no_run


def test_the_scheduler_shows_a_timeout_after_the_result_it_restored() -> None:
    """Through the real scheduler and runner: the result restored from the archive at start-up
    is the page's until the next run, a child that hangs and is killed at its timeout; then the
    page says timeout, when, and why there are no figures, while the gauges' result stays."""
    scheduler = ProbeScheduler(
        ProbingSection(duty_cycle=1.0),
        ProbeRunner(startup_timeout_seconds=60.0),  # the child's manifest comes at once
        TelemetryStore(64),
        TelemetryCapture(),
        (),
        1.0,
    )
    key = ("matmul", "fp32", "eager", SPEC.device.label, "")
    now = time.time()
    assert scheduler.restore([(key, now - 3600, ANALYSED)]) == 1

    def page() -> str:
        sources = LandingSources("node", list, None, scheduler.status)
        return _row(render(sources).decode(), SPEC.device.label)

    assert "<td>ok</td><td>52.00 TFLOP/s steady</td><td>0.875</td><td>flat</td>" in page()
    run = scheduler.run_one(SPEC, force=True, command=child("time.sleep(600)\n"))
    assert run.outcome == "timeout"
    row = page()
    assert f"<td>timeout after {run.ended_at - run.started_at:.0f} s, no figures: " in row
    assert "process group killed after 2 iterations" in row
    assert "0.875" not in row
    assert " s ago</td>" in row  # the timeout's own time, not the restored result's hour
    assert scheduler.status().results[key] is ANALYSED  # what the gauges still hold
