"""Acceptance 1 of issue 7: the real Prometheus server on 127.0.0.1 scrapes a `sustain run` that
uses the fake NVML driver (two H100s, GPU 1 in HW thermal slowdown throughout) and probes on short
intervals; then every PromQL expression of every dashboard panel and every recording rule returns
data through Prometheus' HTTP API, and the thermal alert is pending or firing for GPU 1 only.

The probes target the fake GPUs, so the agent's GPU code path runs (device locks, the GPU named
by UUID, labels, the analysis with the GPU's telemetry); the probe interpreter is a wrapper that
runs the real workloads on the CPU (`--device cuda:N` becomes `--device cpu`), since there is no
GPU here. The archive is seeded with a fleet history of bf16 matmul results (a stack change and a
thermally degraded device, with peers on other nodes), so the drift child the daemon starts
finds changes and outliers to export. This VM has no hwmon, cpufreq or RAPL: the host collector
reads them from the fixture sysfs tree (procfs is the real one). Rule groups are evaluated every
second here (a copy of the rules file with the group intervals rewritten), so the 5-minute
baseline group answers within the test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import fetch, free_port
from sqlalchemy import insert

from agent.archive.database import open_engine, upgrade
from agent.archive.models import ProbeRunRecord, StackSnapshotRecord
from collectors.stack import StackSnapshot

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
UUID0 = "GPU-00000000-1111-2222-3333-444444444444"
UUID1 = "GPU-55555555-6666-7777-8888-999999999999"
MODEL = "NVIDIA H100 80GB HBM3"
NODE = "e2e-node"

SCENARIO = (
    f"""
set driver_version 550.54.15
set nvml_version 12.550.54.15
set cuda_driver_version 12040
device 0 name "{MODEL}" uuid {UUID0} serial 1650000000001 pci_bus_id 00000000:18:00.0
device 1 name "{MODEL}" uuid {UUID1} serial 1650000000002 pci_bus_id 00000000:2A:00.0
"""
    + "".join(
        f"""
device {d} memory_total_bytes 85899345920 memory_reserved_bytes 553648128
device {d} max_sm_clock_mhz 1980 max_mem_clock_mhz 2619 max_graphics_clock_mhz 1985
device {d} power_limit_mw 700000 slowdown_temp_c 87 shutdown_temp_c 92
device {d} max_pcie_gen 5 max_pcie_width 16 gpm_supported 1 energy_mj 5000000
at 0 {d} mem_clock_mhz 2619 power_mw 350000 mem_temp_c 70 gpu_util_pct 90 mem_util_pct 40
at 0 {d} memory_used_bytes 1073741824 pcie_gen 4 pcie_width 8 pcie_tx_kbps 1000 pcie_rx_kbps 2000
at 0 {d} fan_pct 55 pstate 2 ecc_corrected 12 ecc_uncorrected 1
at 0 {d} remapped_corrected 3 remapped_uncorrected 1 remapped_pending 1 remapped_failure 0
at 0 {d} gpm_dram_bw_util_pct 55 gpm_sm_occupancy_pct 45 gpm_tensor_util_pct 60
"""
        for d in (0, 1)
    )
    + """
at 0 0 sm_clock_mhz 1410 graphics_clock_mhz 1405 gpu_temp_c 65 reasons 0x0
at 0 1 sm_clock_mhz 1100 graphics_clock_mhz 1095 gpu_temp_c 88 reasons 0x40
at 30 1 ecc_uncorrected 2
xid 0 5 79
xid 1 6 13
"""
)

# Every probe's throughput, whatever its unit (one family per unit), for failure messages.
THROUGHPUT = '{__name__=~"sustain_probe_(flops|bytes_per_second|tokens_per_second)"}'

# The probe interpreter: the real workloads, on the CPU instead of the GPU they were given. Each
# fake GPU's solo probes get a core of their own (GPU N: the Nth core the agent may use, one
# torch thread), as real GPUs do not share their compute: a probe on GPU 0 then keeps its steady
# state while GPU 1's probes start and stop (on shared cores, each start is a step). The children
# of a node-wide run (--start-on-stdin) share the first core: each keeps about half of its solo
# throughput, the loss the node-wide panels and the coupling cause show.
WRAPPER = """#!{python}
import os, sys
argv = sys.argv[1:]
args = ["cpu" if arg.startswith("cuda") else arg for arg in argv]
if "run" in args:
    device = argv[argv.index("--device") + 1] if "--device" in argv else "cpu"
    index = int(device.partition(":")[2] or 0)
    cores = sorted(os.sched_getaffinity(0))
    core = cores[0 if "--start-on-stdin" in args else index % len(cores)]
    args += ["--cpus", str(core), "--threads", "1"]
os.execv({python!r}, [{python!r}, *args])
"""


def stack(driver: str) -> StackSnapshot:
    return StackSnapshot({"driver": {"version": driver}, "gpus": [{"model": MODEL}] * 2})


def seed(url: str) -> None:
    """60 hourly bf16 matmul results per device: this node's two GPUs and three peer nodes'.
    All get a driver upgrade at result 30 (-8%); this node's GPU 1 degrades thermally at 45."""
    old, new = stack("550.54.15"), stack("555.42.02")
    rows = []
    start = datetime.now(UTC) - timedelta(hours=61)
    nodes = [(NODE, UUID0, "0"), (NODE, UUID1, "1")] + [
        (f"peer-{n}", f"GPU-peer-{n}-{d}", str(d)) for n in range(3) for d in range(2)
    ]
    for node, device, label in nodes:
        for index in range(60):
            hot = device == UUID1 and index >= 45
            steady = 700e12 * (0.92 if index >= 30 else 1.0) * (0.88 if hot else 1.0)
            steady *= 1 + 0.005 * ((index * 7919 + hash(device)) % 7 - 3) / 3
            ended = start + timedelta(hours=index)
            rows.append(
                {
                    "run_id": uuid.uuid4().hex,
                    "node": node,
                    "device": device,
                    "device_label": label,
                    "device_model": MODEL,
                    "stack_id": (new if index >= 30 else old).id,
                    "workload": "matmul",
                    "precision": "bf16",
                    "optimization": "eager",
                    "outcome": "ok",
                    "reason": "",
                    "started_at": ended - timedelta(seconds=20),
                    "ended_at": ended,
                    "duration_seconds": 20.0,
                    "iterations": 100,
                    "stderr_tail": "",
                    "unit": "FLOP/s",
                    "steady_throughput": steady,
                    "steady_sm_clock_hertz": 1.1e9 if hot else 1.41e9,
                    "steady_thermal_share": 1.0 if hot else 0.0,
                }
            )
    engine = open_engine(url)
    try:
        upgrade(engine)
        with engine.begin() as connection:
            for snapshot in (old, new):
                connection.execute(
                    insert(StackSnapshotRecord).values(
                        stack_id=snapshot.id, facts=snapshot.canonical_json(), first_seen_at=start
                    )
                )
            connection.execute(insert(ProbeRunRecord), rows)
    finally:
        engine.dispose()


def rules_every_second(path: Path) -> None:
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        group["interval"] = "1s"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))


def api(base: str, path: str, **params: str) -> Any:
    query = urllib.parse.urlencode(params)
    status, body = fetch(f"{base}/api/v1/{path}?{query}", timeout=10)
    assert status == 200, body
    answer = json.loads(body)
    assert answer["status"] == "success", answer
    return answer["data"]


def load_queries() -> list[tuple[str, str, str]]:
    spec = importlib.util.spec_from_file_location(
        "grafana_queries", ROOT / "grafana" / "queries.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.dashboard_queries())


def start_agent(fake_nvml: Path, tmp_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`sustain run` on the fake GPUs of SCENARIO with its archive seeded and the probe plan
    below, logging to tmp_path/agent.log; returns the process and its host:port."""
    data = tmp_path / "agent"
    data.mkdir()
    seed(f"sqlite:///{data}/sustain.db")
    (tmp_path / "scenario.scn").write_text(SCENARIO)
    wrapper = tmp_path / "probe-python"
    wrapper.write_text(WRAPPER.format(python=sys.executable))
    wrapper.chmod(0o755)
    agent_port = free_port()
    (tmp_path / "sustain.toml").write_text(
        textwrap.dedent(
            f"""
            [agent]
            node = "{NODE}"
            [host]
            sysfs = "{ROOT / "tests" / "fixtures" / "host" / "sys"}"
            [drift]
            interval_seconds = 10
            [stack]
            interval_seconds = 10
            [probing]
            initial_delay_seconds = 10  # Prometheus scrapes the stack-change counter at 0 first
            duty_cycle = 1.0
            busy_gpu_utilization = 1.0
            busy_cpu_utilization = 1.0
            # Traini et al.'s published tolerance: this stack checks plumbing, and its own probes
            # (the node-wide matmul uses both cores) shift the CPU inference runs they overlap.
            tolerance = 0.05
            python = "{wrapper}"
            [[probing.plan]]
            workload = "matmul"
            precisions = ["fp32"]
            duration_seconds = 4  # three whole one-second windows at least: a p10 and a p50
            # The default size, shrunk to fit: iterations of ~0.1 s settle into a steady state
            # where the microsecond "small" ones may not (the node-wide panel needs solo steady).
            interval_seconds = 30
            jitter_seconds = 0
            [[probing.plan]]
            workload = "matmul"
            precisions = ["fp32"]
            duration_seconds = 4
            interval_seconds = 30
            jitter_seconds = 0
            scope = "node"  # both GPUs at once: the node-wide panels
            [[probing.plan]]
            workload = "inference"
            precisions = ["fp32"]
            duration_seconds = 10  # 30 decode steps even at 0.33 s each on a loaded machine
            size = "small"
            # Every minute, as membw below: a run that found no steady state (another probe
            # started or ended in its last stretch) is followed by one that may.
            interval_seconds = 60
            jitter_seconds = 0
            [[probing.plan]]
            workload = "membw"
            precisions = ["fp32"]
            duration_seconds = 3
            size = "small"
            interval_seconds = 60
            jitter_seconds = 0
            [[probing.plan]]
            workload = "attention"
            precisions = ["fp32"]
            duration_seconds = 2
            size = "small"
            interval_seconds = 300
            jitter_seconds = 0
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUSTAIN_", "FAKENVML_"))}
    env |= {
        "LD_LIBRARY_PATH": str(fake_nvml.parent),
        "FAKENVML_SCENARIO": str(tmp_path / "scenario.scn"),
    }
    with (tmp_path / "agent.log").open("w") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--config", str(tmp_path / "sustain.toml"),
             "--listen", f"127.0.0.1:{agent_port}", "--data-dir", str(data)],
            stdout=subprocess.DEVNULL, stderr=log, env=env,
        )  # fmt: skip
    return agent, f"127.0.0.1:{agent_port}"


def start_prometheus(
    tmp_path: Path, target: str, **config: Any
) -> tuple[subprocess.Popen[bytes], str]:
    """The Prometheus server scraping `target` as job "sustain" every second with the shipped
    rules evaluated every second, plus `config` (top-level keys of prometheus.yml), logging to
    tmp_path/prometheus.log; returns the process and its base URL."""
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.fail("the Prometheus server is needed (Debian package 'prometheus')")
    port = free_port()
    rules_every_second(tmp_path / "rules.yml")
    (tmp_path / "prometheus.yml").write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(tmp_path / "rules.yml"), str(RULES.parent / "dcgm-bridge.yml")],
                "scrape_configs": [
                    {"job_name": "sustain", "static_configs": [{"targets": [target]}]}
                ],
            }
            | config
        )
    )
    with (tmp_path / "prometheus.log").open("w") as log:
        server = subprocess.Popen(
            [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
    return server, f"http://127.0.0.1:{port}"


def stop(*processes: subprocess.Popen[bytes]) -> None:
    """Terminate, in order, and wait; kill what does not exit in 20 s."""
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture
def stack_running(fake_nvml: Path, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The agent and Prometheus, running; yields Prometheus' base URL and the data directory."""
    agent, target = start_agent(fake_nvml, tmp_path)
    processes = [agent]
    try:
        server, base = start_prometheus(tmp_path, target)
        processes.insert(0, server)
        yield base, tmp_path
    finally:
        stop(*processes)


# A CPU inference run that one of the stack's other probes overlapped shifts and finds no steady
# state (truly: its throughput moved); a steady one comes within a few of its one-minute runs.
SLOW_FIGURES = {'sustain_probe_tokens_per_second{stat="steady"}': 480.0}


def wait_for(base: str, expr: str, timeout: float, logs: Path) -> list[Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result: list[Any] = api(base, "query", query=expr)["result"]
        except OSError:
            result = []
        if result:
            return result
        time.sleep(1)
    pytest.fail(f"{expr} returned nothing in {timeout} s\n{(logs / 'agent.log').read_text()}")


@pytest.mark.timeout(900)  # waits of up to 480 s + 185 s for a steady CPU inference run
def test_every_dashboard_query_and_rule_returns_data(stack_running: tuple[str, Path]) -> None:
    base, logs = stack_running
    # What the slowest parts need: the drift child's first run, an inference and an attention
    # probe (the SDPA backend it picks is a stack change), the latest probe results.
    for expr in (
        "sustain_drift_fleet_outlier",
        "sustain_probe_latency_seconds",
        "increase(sustain_stack_changes_total[5m]) > 0",
        'sustain_probe_flops{stat="steady",uuid!=""}',
        'sustain_probe_bytes_per_second{stat="steady"}',  # membw: the B/s rules need one
        'sustain_probe_tokens_per_second{stat="steady"}',  # inference: the tokens/s rules
        'sustain_probe_node_coupling_ratio{device="node"}',  # a node-wide run after a solo one
        "instance_device:sustain_probe_flops_steady:median7d",
    ):
        wait_for(base, expr, SLOW_FIGURES.get(expr, 240), logs)
    time.sleep(5)  # a few more evaluations of every rule group

    rules = yaml.safe_load(RULES.read_text())
    records = [r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r]
    assert records
    wanted = [(f"{dashboard} / {title}: {expr}", expr) for dashboard, title, expr in load_queries()]
    wanted += [(f"recording rule {record}", record) for record in records]
    missing = [
        (name, expr) for name, expr in wanted if not api(base, "query", query=expr)["result"]
    ]
    # A figure the latest run lacks (a node-wide run, or a CPU inference run another probe
    # overlapped, that found no steady state) comes back with a later run: what is empty gets up
    # to three of the one-minute plan intervals more.
    deadline = time.monotonic() + 185
    while missing and time.monotonic() < deadline:
        time.sleep(2)
        missing = [(n, e) for n, e in missing if not api(base, "query", query=e)["result"]]
    empty = [name for name, _ in missing]
    # On failure, what the probes did: tells a missing run from a missing figure.
    probes = (
        ""
        if not empty
        else (
            f"\nthroughput: {api(base, 'query', query=THROUGHPUT)['result']}"
            f"\n{(logs / 'agent.log').read_text()[-6000:]}"
        )
    )
    assert not empty, "no data:\n" + "\n".join(empty) + probes

    # The thermal alert: pending or firing for the throttled GPU (1) only.
    alerts = [
        alert
        for alert in api(base, "alerts")["alerts"]
        if alert["labels"]["alertname"] == "SustainGpuThermalThrottling"
    ]
    assert alerts, (logs / "agent.log").read_text()
    assert {alert["labels"]["uuid"] for alert in alerts} == {UUID1}
    assert all(alert["state"] in ("pending", "firing") for alert in alerts)


def grafana_regex(values: list[str]) -> str:
    """A multi-value variable set to All, as Grafana writes it into a `=~` matcher: each value's
    regex characters escaped (twice: once for PromQL's string), joined in one group."""
    escaped = [re.sub(r"[$^*{}\[\]'+?.()|\\]", lambda m: "\\\\" + m.group(0), v) for v in values]
    return "(" + "|".join(escaped) + ")"


def test_dcgm_dashboard_queries_over_the_bridge(stack_running: tuple[str, Path]) -> None:
    """deploy/prometheus/dcgm-bridge.yml: queries written the way dcgm-exporter's Grafana dashboard
    writes them (its Hostname and gpu variables, and the older instance one) return data for every
    bridged field of its default counters, in DCGM's units and with DCGM's labels."""
    base, logs = stack_running
    wait_for(base, 'DCGM_FI_DEV_XID_ERRORS{gpu="1"} == 13', 120, logs)  # the last to arrive
    bridge = yaml.safe_load((RULES.parent / "dcgm-bridge.yml").read_text())
    fields = [r["record"] for g in bridge["groups"] for r in g["rules"] if "DCGM_" in r["record"]]
    assert len(fields) >= 20

    # The dashboard's variables, resolved as Grafana resolves them: label values of FB_FREE.
    hosts = api(base, "label/Hostname/values", **{"match[]": "DCGM_FI_DEV_FB_FREE"})
    assert hosts == ["127.0.0.1"]
    hostname = grafana_regex(hosts)
    gpus = api(
        base, "label/gpu/values", **{"match[]": f'DCGM_FI_DEV_FB_FREE{{Hostname=~"{hostname}"}}'}
    )
    assert gpus == ["0", "1"]
    gpu = grafana_regex(gpus)
    instances = api(base, "label/instance/values", **{"match[]": "DCGM_FI_DEV_GPU_TEMP"})
    selector = f'{{Hostname=~"{hostname}", gpu=~"{gpu}"}}'
    by_instance = f'{{instance=~"{grafana_regex(instances)}", gpu=~"{gpu}"}}'

    def query(expr: str) -> list[Any]:
        result: list[Any] = api(base, "query", query=expr)["result"]
        assert result, f"no data: {expr}"
        return result

    labels = {}
    for field in fields:
        for expr in (
            f"max({field}{selector}) by (Hostname, gpu, UUID)",
            f"{field}{by_instance}",
            f"sum({field}{selector}) by (gpu)",
        ):
            assert {s["metric"]["gpu"] for s in query(expr)} == {"0", "1"}, expr
        for sample in query(f"{field}{selector}"):
            labels[(field, sample["metric"]["gpu"])] = sample["metric"]
    for (field, index), metric in labels.items():
        assert metric["UUID"] == (UUID0, UUID1)[int(index)], field
        assert metric["device"] == f"nvidia{index}", field
        assert metric["modelName"] == MODEL, field
        assert metric["Hostname"] == "127.0.0.1", field
        assert metric["DCGM_FI_DRIVER_VERSION"] == "550.54.15", field
        assert metric["pci_bus_id"].lower() == ("00000000:18:00.0", "00000000:2a:00.0")[int(index)]
        assert "uuid" not in metric, field

    # NVIDIA's panels as written, and the scenario's readings in DCGM's units.
    assert float(query(f"avg(DCGM_FI_DEV_GPU_TEMP{selector})")[0]["value"][1]) == 76.5
    power = query(f"sum(max(DCGM_FI_DEV_POWER_USAGE{selector}) by (gpu))")
    assert float(power[0]["value"][1]) == pytest.approx(700, rel=0.01)
    clocks = query(f"max(DCGM_FI_DEV_SM_CLOCK{selector} * 1000000) by (Hostname, UUID, gpu)")
    assert {s["metric"]["gpu"]: float(s["value"][1]) for s in clocks} == {"0": 1.41e9, "1": 1.1e9}
    for panel in ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"):
        query(f"max({panel}{selector}) by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE)")
    expected = {
        "DCGM_FI_DEV_MEM_CLOCK": 2619,
        "DCGM_FI_DEV_MEMORY_TEMP": 70,
        "DCGM_FI_DEV_GPU_UTIL": 90,
        "DCGM_FI_DEV_MEM_COPY_UTIL": 40,
        "DCGM_FI_DEV_FB_USED": 1024,
        "DCGM_FI_DEV_FB_RESERVED": 528,
        "DCGM_FI_DEV_FB_FREE": 81920 - 528 - 1024,
        "DCGM_FI_DEV_PCIE_TX_THROUGHPUT": 1000,
        "DCGM_FI_DEV_PCIE_RX_THROUGHPUT": 2000,
        "DCGM_FI_PROF_PCIE_TX_BYTES": 1000 * 1024,
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": 3,
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": 1,
        "DCGM_FI_DEV_ROW_REMAP_FAILURE": 0,
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": 12,
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.9,
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": 0.6,
        "DCGM_FI_PROF_DRAM_ACTIVE": 0.55,
        "DCGM_FI_PROF_SM_OCCUPANCY": 0.45,
    }
    for field, value in expected.items():
        got = float(query(f'{field}{{gpu="0"}}')[0]["value"][1])
        assert got == pytest.approx(value, rel=1e-6), field
    xids = query(f"DCGM_FI_DEV_XID_ERRORS{selector}")
    assert {s["metric"]["gpu"]: float(s["value"][1]) for s in xids} == {"0": 79, "1": 13}
    energy = query('DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu="0"}')
    assert float(energy[0]["value"][1]) >= 5e6  # mJ: the scenario's 5000 J at least
