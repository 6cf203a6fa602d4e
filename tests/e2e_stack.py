"""The end-to-end stack that tests/test_prometheus_e2e.py and tests/test_victoriametrics.py share:
VictoriaMetrics, a `sustain run` on the fake NVML driver, and the real Prometheus scraping the
agent and remote-writing everything to VictoriaMetrics, all on 127.0.0.1.

Both modules load this one as a plugin (`pytest_plugins`), which gives them the fixture
`e2e_stack` and hooks that start the stack once per test process: the tests that use it are put
in one row (where the first of them is collected), the first of them starts it, and it stops after
the last (its probes keep both cores busy: the tests after it should not pay for that). They
carry `@pytest.mark.xdist_group("e2e-stack")`, so that under `pytest -n N --dist loadgroup` one
worker runs them all and the stack starts once in all (tests/test_suite_runner.py checks that
the installed pytest and pytest-xdist keep a group on one worker).

The agent runs on two fake H100s (GPU 1 in HW thermal slowdown throughout) and probes on short
intervals. The probes target the fake GPUs, so the agent's GPU code path runs (device locks, the
GPU named by UUID, labels, the analysis with the GPU's telemetry); the probe interpreter is a
wrapper that runs the real workloads on the CPU (`--device cuda:N` becomes `--device cpu`), since
there is no GPU here. The archive is seeded with a fleet history of bf16 matmul results (a stack
change and a thermally degraded device, with peers on other nodes), so the drift child the daemon
starts finds changes and outliers to export. This VM has no hwmon, cpufreq or RAPL: the host
collector reads them from the fixture sysfs tree (procfs is the real one). Rule groups are
evaluated every second here (a copy of the rules file with the group intervals rewritten), so the
5-minute baseline group answers within the tests.

The stack checks plumbing (every figure reaches Prometheus and VictoriaMetrics, every query and
rule answers), not the steady-state analysis, which tests/test_analysis*.py and
tests/test_probe_analysis.py check on real and synthetic series. Its probes overlap each other
on two shared cores while the rest of the suite runs beside them, so the analysis runs with a
wide tolerance here (see `[probing] tolerance` below) and every run settles quickly.

VictoriaMetrics' `-search.latencyOffset` (30 s by default: the newest samples are hidden from
queries) is set to 1 s so that the tests do not wait for it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.parse
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
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
GROUP = "e2e-stack"  # the xdist_group of every test that uses the stack

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

# The agent's configuration; {sysfs} and {wrapper} are filled in.
CONFIG = """
[agent]
node = "{node}"
[host]
sysfs = "{sysfs}"
[drift]
interval_seconds = 10
[stack]
interval_seconds = 10
[probing]
initial_delay_seconds = 10  # Prometheus scrapes the stack-change counter at 0 first
duty_cycle = 1.0
busy_gpu_utilization = 1.0
busy_cpu_utilization = 1.0
# Wide, on purpose (Traini et al. publish 0.05; the default is 0.02): this stack checks that
# every figure gets through, not what the analysis makes of a series. Its probes overlap each
# other on two cores and the rest of the suite runs beside them, so at 5% a CPU inference run
# the node-wide matmul overlapped often ended no_steady_state and its figures came minutes late,
# or not at all. At 50% a run settles unless another probe halves or doubles its throughput at
# the end; the analysis' own tests hold it to the published tolerances on real data.
tolerance = 0.5
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
# Every minute, as membw below: a run that found no steady state all the same (another probe
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
# Its first run picks the SDPA backend: a stack change (the Stack changes annotation), once; a
# later run picks the same backend, so a shorter interval would bring no more changes.
interval_seconds = 300
jitter_seconds = 0
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
    """GET /api/v1/`path` of Prometheus or VictoriaMetrics: its data (status success, or fail)."""
    query = urllib.parse.urlencode(params)
    status, body = fetch(f"{base}/api/v1/{path}?{query}", timeout=10)
    assert status == 200, body
    answer = json.loads(body)
    assert answer["status"] == "success", answer
    return answer["data"]


def query_range(base: str, expr: str, start: float) -> list[Any]:
    """The expression over [start, now] every 2 s, as a Grafana graph or annotation asks for it."""
    params = {"query": expr, "start": f"{start:.3f}", "end": f"{time.time():.3f}", "step": "2s"}
    status, body = fetch(f"{base}/api/v1/query_range?{urllib.parse.urlencode(params)}", 10)
    assert status == 200, f"{expr}: {body}"
    answer = json.loads(body)
    assert answer["status"] == "success", answer
    result: list[Any] = answer["data"]["result"]
    return result


def load_queries() -> list[tuple[str, str, str]]:
    spec = importlib.util.spec_from_file_location(
        "grafana_queries", ROOT / "grafana" / "queries.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.dashboard_queries())


def start_agent(fake_nvml: Path, directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`sustain run` on the fake GPUs of SCENARIO with its archive seeded and the probe plan of
    CONFIG, logging to directory/agent.log; returns the process and its host:port."""
    data = directory / "agent"
    data.mkdir()
    seed(f"sqlite:///{data}/sustain.db")
    (directory / "scenario.scn").write_text(SCENARIO)
    wrapper = directory / "probe-python"
    wrapper.write_text(WRAPPER.format(python=sys.executable))
    wrapper.chmod(0o755)
    agent_port = free_port()
    sysfs = ROOT / "tests" / "fixtures" / "host" / "sys"
    (directory / "sustain.toml").write_text(
        textwrap.dedent(CONFIG.format(node=NODE, sysfs=sysfs, wrapper=wrapper))
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUSTAIN_", "FAKENVML_"))}
    env |= {
        "LD_LIBRARY_PATH": str(fake_nvml.parent),
        "FAKENVML_SCENARIO": str(directory / "scenario.scn"),
    }
    with (directory / "agent.log").open("w") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--config", str(directory / "sustain.toml"),
             "--listen", f"127.0.0.1:{agent_port}", "--data-dir", str(data)],
            stdout=subprocess.DEVNULL, stderr=log, env=env,
        )  # fmt: skip
    return agent, f"127.0.0.1:{agent_port}"


def start_prometheus(
    directory: Path, target: str, **config: Any
) -> tuple[subprocess.Popen[bytes], str]:
    """The Prometheus server scraping `target` as job "sustain" every second with the shipped
    rules evaluated every second, plus `config` (top-level keys of prometheus.yml), logging to
    directory/prometheus.log; returns the process and its base URL."""
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.fail("the Prometheus server is needed (Debian package 'prometheus')")
    port = free_port()
    rules_every_second(directory / "rules.yml")
    (directory / "prometheus.yml").write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [
                    str(directory / "rules.yml"),
                    str(RULES.parent / "dcgm-bridge.yml"),
                ],
                "scrape_configs": [
                    {"job_name": "sustain", "static_configs": [{"targets": [target]}]}
                ],
            }
            | config
        )
    )
    with (directory / "prometheus.log").open("w") as log:
        server = subprocess.Popen(
            [prometheus, f"--config.file={directory / 'prometheus.yml'}",
             f"--storage.tsdb.path={directory / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
    return server, f"http://127.0.0.1:{port}"


def victoria_metrics() -> str:
    binary = shutil.which("victoria-metrics")
    if binary is None:
        pytest.fail(
            "VictoriaMetrics is not installed: apt-get install victoria-metrics "
            "(tests/run.sh does)",
            pytrace=False,
        )
    return binary


def start_victoria_metrics(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    """VictoriaMetrics with its data in directory/victoria-metrics, logging to
    directory/victoria-metrics.log; returns the process and its base URL."""
    binary = victoria_metrics()
    base = f"http://127.0.0.1:{free_port()}"
    with (directory / "victoria-metrics.log").open("w") as log:
        vm = subprocess.Popen(
            [binary, f"-httpListenAddr={base.removeprefix('http://')}",
             f"-storageDataPath={directory / 'victoria-metrics'}", "-retentionPeriod=1d",
             "-search.latencyOffset=1s", "-search.disableCache", "-loggerLevel=WARN"],
            stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
    return vm, base


def wait_until_ready(
    name: str, url: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 60
) -> None:
    """Until `url` answers 200 (a server's health or readiness endpoint); fails, with the log,
    if the process exits or `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{name} exited with {process.returncode}:\n{log.read_text()}")
        try:
            if fetch(url, timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    pytest.fail(f"{name} did not answer {url} in {timeout} s:\n{log.read_text()}")


def stop(*processes: subprocess.Popen[bytes]) -> None:
    """Terminate, in order, and wait; kill what does not exit in 20 s."""
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass(frozen=True)
class Stack:
    """The running stack: Prometheus' and VictoriaMetrics' base URLs, the directory with the
    logs (agent.log, prometheus.log, victoria-metrics.log), and when the stack started (Unix
    time: the start of the span a range query covers)."""

    prometheus: str
    victoria_metrics: str
    logs: Path
    started: float

    def agent_log(self, tail: int = 20000) -> str:
        return (self.logs / "agent.log").read_text()[-tail:]


class _Running:
    """The stack of this test process while it runs, and its processes: Prometheus, the agent,
    VictoriaMetrics."""

    stack: Stack | None = None
    processes: tuple[subprocess.Popen[bytes], ...] = ()


def _start(fake_nvml: Path, directory: Path) -> None:
    started = time.time()
    vm, vm_base = start_victoria_metrics(directory)
    processes = [vm]
    try:
        wait_until_ready(
            "VictoriaMetrics", f"{vm_base}/health", vm, directory / "victoria-metrics.log"
        )
        agent, target = start_agent(fake_nvml, directory)
        processes.insert(0, agent)
        remote_write = {
            "url": f"{vm_base}/api/v1/write",
            "queue_config": {"batch_send_deadline": "1s", "max_backoff": "1s"},
        }
        server, base = start_prometheus(directory, target, remote_write=[remote_write])
        processes.insert(0, server)
        # Prometheus answers its API with 503 until its TSDB is open: wait for that here, so
        # that a test's first query is answered (or fails on its own terms).
        wait_until_ready("Prometheus", f"{base}/-/ready", server, directory / "prometheus.log")
    except BaseException:
        _stop_all(processes)
        raise
    _Running.stack = Stack(base, vm_base, directory, started)
    _Running.processes = tuple(processes)


def _stop_all(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    """Prometheus and the agent, then VictoriaMetrics (the last of `processes`) once they are
    gone: Prometheus flushes its remote-write queue on the way out."""
    stop(*processes[:-1])
    stop(*processes[-1:])


def _stop() -> None:
    processes, _Running.processes, _Running.stack = _Running.processes, (), None
    _stop_all(processes)


@pytest.fixture
def e2e_stack(fake_nvml: Path, tmp_path_factory: pytest.TempPathFactory) -> Stack:
    """VictoriaMetrics, the agent and Prometheus remote-writing to VictoriaMetrics, running and
    answering. Started by the first test that asks for it and kept for the next ones; stopped
    after the last of a row of them (the hooks below put them in one row), not at the end of
    the session: its probes keep both cores busy, which the tests after it should not pay for."""
    if _Running.stack is None:
        _start(fake_nvml, tmp_path_factory.mktemp("e2e-stack"))
    assert _Running.stack is not None
    return _Running.stack


def _uses_stack(item: pytest.Item | None) -> bool:
    return item is not None and "e2e_stack" in getattr(item, "fixturenames", ())


@pytest.hookimpl(trylast=True)  # after conftest.py's order (slow tests first) and xdist's hook
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that use the stack in one row, where the first of them is: they run one after
    the other, the stack starts once, and no other test runs beside it. (Under pytest-xdist,
    their xdist_group sends them all to one worker, in this order.)"""
    users = [item for item in items if _uses_stack(item)]
    if not users:
        return
    first = items.index(users[0])
    others = [item for item in items if not _uses_stack(item)]
    items[:] = others[:first] + users + others[first:]


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """The stack stops after the last test of its row."""
    if _Running.stack is not None and not _uses_stack(nextitem):
        _stop()


def pytest_sessionfinish() -> None:
    """And at the end of the session, whatever ran last (an interrupted run)."""
    if _Running.stack is not None:
        _stop()


def answered(base: str, expr: str, since: float | None = None) -> bool:
    """Whether `expr` returns data now, or (with `since`) at some step of [since, now]."""
    try:
        if api(base, "query", query=expr)["result"]:
            return True
        return since is not None and bool(query_range(base, expr, since))
    except OSError:  # a busy server that did not answer in time: ask again
        return False


def wait_for(
    stack: Stack, base: str, expr: str, deadline: float, since: float | None = None
) -> None:
    """Until `expr` returns data from `base` (see `answered`); fails with the agent's log at
    `deadline` (time.monotonic())."""
    started = time.monotonic()
    while not answered(base, expr, since):
        if time.monotonic() >= deadline:
            pytest.fail(
                f"{expr} returned nothing in {time.monotonic() - started:.0f} s "
                f"({time.time() - stack.started:.0f} s after the stack started)\n"
                f"{stack.agent_log()}"
            )
        time.sleep(1)


STACK_CHANGES = "increase(sustain_stack_changes_total[5m]) > 0"  # the Stack changes annotation
# What the slowest parts need: the drift child's first run, an inference and an attention probe
# (the SDPA backend it picks is a stack change), the latest probe results. With the stack's wide
# analysis tolerance each comes with the first runs of its probe, within about two minutes of the
# stack's start on an idle machine; FIGURES_SECONDS is for a loaded one.
SLOW_FIGURES = (
    "sustain_drift_fleet_outlier",
    "sustain_probe_latency_seconds",
    STACK_CHANGES,
    'sustain_probe_flops{stat="steady",uuid!=""}',
    'sustain_probe_bytes_per_second{stat="steady"}',  # membw: the B/s rules need one
    'sustain_probe_tokens_per_second{stat="steady"}',  # inference: the tokens/s rules
    'sustain_probe_node_coupling_ratio{device="node"}',  # a node-wide run after a solo one
    "instance_device:sustain_probe_flops_steady:median7d",
)
FIGURES_SECONDS = 300.0


def wait_for_figures(stack: Stack, base: str, *, since_start: bool = False) -> None:
    """Until every SLOW_FIGURES expression returns data from `base`, within FIGURES_SECONDS of
    the call: now, or over the stack's span with `since_start` and for the stack-change
    annotation (the stack changes once, early: see test_prometheus_e2e.py)."""
    deadline = time.monotonic() + FIGURES_SECONDS
    for expr in SLOW_FIGURES:
        since = stack.started if since_start or expr == STACK_CHANGES else None
        wait_for(stack, base, expr, deadline, since)
