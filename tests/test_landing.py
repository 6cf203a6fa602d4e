"""The landing page at /: the node, its collectors, each device's health verdict and latest probe,
and the links, from a real agent on the fake NVML driver (probes on the fake GPUs run through the
CPU wrapper interpreter) and on a node without NVML; hostile names are escaped.
"""

from __future__ import annotations

import textwrap
import time
import urllib.request
from pathlib import Path

from conftest import Running, cpu_wrapper, fetch, start_agent

from agent.exporter.landing import LandingSources, render
from agent.health.monitor import DeviceHealth
from agent.health.rules import Finding
from agent.probes.analysis import RunAnalysis
from agent.probes.attribution import Attribution
from agent.probes.scheduler import ProbeResult, ProbeStatus
from agent.telemetry.sampler import LoopStatus

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


def test_the_page_of_a_gpu_node_with_a_probe(fake_nvml: Path, tmp_path: Path) -> None:
    (tmp_path / "node.scn").write_text(SCENARIO)
    wrapper, _ = cpu_wrapper(tmp_path)
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
            duration_seconds = 3
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
        page = _page(running, ("xid_79", "matmul fp32 eager"), timeout=150)
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
    # The latest probe of a GPU that was probed: workload, its sustained ratio, classification.
    probed = [row for row in (gpu0, gpu1) if "matmul fp32 eager" in row]
    assert probed, page
    cells = probed[0].split("<td>")
    ratio, classification = cells[-2].removesuffix("</td>"), cells[-1].removesuffix("</td>")
    assert ratio == "" or 0.0 < float(ratio) <= 1.5
    assert classification.split(" ")[0] in ("flat", "warmup", "slowdown", "no_steady_state")
    # Links.
    assert '<a href="/metrics">' in page
    assert '<a href="/healthz">' in page
    assert f'<a href="{DOCS}/health.md">' in page
    assert f'<a href="{DOCS}/metrics.md">' in page


def test_the_page_of_a_cpu_only_node_says_why_nvml_is_absent(tmp_path: Path) -> None:
    config = tmp_path / "sustain.toml"
    config.write_text("[probing]\nenabled = false\n[health]\nenabled = false\n")
    running = start_agent(tmp_path / "data", "--config", str(config))
    try:
        page = _page(running, ("<td>nvml</td>", "<td>host</td>"), timeout=30)
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
        {"sustained_ratio": 0.875, "classification": "slowdown<"},
        Attribution((), "thermal&", None, ""),
    )
    status = ProbeStatus({}, {key: 100.0}, {}, {}, {key: ProbeResult("FLOP/s", "flop", analysis)})
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
    assert "<td>30 s ago</td>" in page
    assert "<td class=absent>absent</td>" in page
    assert "no &lt;driver&gt;" in page
