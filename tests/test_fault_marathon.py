"""The faults of the earlier issues together, in one long run of the real agent (issue 8): a GPU
lost and back, NVML timeouts, a probe child that crashes and one that hangs, and the archive
database (a private PostgreSQL instance) stopped and started again, all within about 90 s.

The probes target the two fake GPUs; the probe interpreter is a wrapper that runs the real
workloads on the CPU, except for the second probe, which aborts (SIGABRT), and the third, which
hangs until the runner kills its process group at the timeout. Afterwards: the agent never died
and stopped cleanly, every fault left its trace (events, counters, outcomes with reasons), every
run it finished is in the database exactly once, and the rollups have no gap.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from conftest import PrivatePostgres, fetch, free_port
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, text

from agent.archive.database import open_engine, upgrade

UUID0 = "GPU-00000000-1111-2222-3333-444444444444"
UUID1 = "GPU-55555555-6666-7777-8888-999999999999"

SCENARIO = f"""
device 0 name "NVIDIA H100 80GB HBM3" uuid {UUID0}
device 1 name "NVIDIA H100 80GB HBM3" uuid {UUID1}
at 0 0 sm_clock_mhz 1410 power_mw 500000 reasons 0x0
at 0 1 sm_clock_mhz 1410 power_mw 500000 reasons 0x0
fault 0 lost - 20 35
fault 1 timeout nvmlDeviceGetTotalEnergyConsumption 40 50
"""

# Probe runs are counted in a file; the 2nd aborts, the 3rd hangs, the rest run on the CPU.
WRAPPER = """#!{python}
import os, sys, time
args = sys.argv[1:]
if args[:3] == ["-m", "workloads", "run"]:
    counter = {counter!r}
    with open(counter, "a+") as f:
        f.seek(0)
        n = len(f.read()) + 1
        f.write("x")
    if n == 2:
        os.abort()
    if n == 3:
        time.sleep(3600)
args = ["cpu" if arg.startswith("cuda") else arg for arg in args]
os.execv({python!r}, [{python!r}, *args])
"""


def metric_sum(body: str, name: str, **labels: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def test_every_fault_at_once(
    fake_nvml: Path, private_postgres: PrivatePostgres, tmp_path: Path
) -> None:
    engine = open_engine(private_postgres.url)
    upgrade(engine)
    engine.dispose()
    (tmp_path / "faults.scn").write_text(SCENARIO)
    wrapper = tmp_path / "probe-python"
    wrapper.write_text(WRAPPER.format(python=sys.executable, counter=str(tmp_path / "probe-count")))
    wrapper.chmod(0o755)
    (tmp_path / "sustain.toml").write_text(
        textwrap.dedent(
            f"""
            [agent]
            node = "marathon"
            [archive]
            database_url = "{private_postgres.url}"
            rollup_seconds = 10
            # The fleet database gets the rollups too (the default keeps them on the node), so
            # that they cross the outage through the spool.
            fleet_rollup_seconds = 10
            [probing]
            initial_delay_seconds = 0
            duty_cycle = 1.0
            busy_gpu_utilization = 1.0
            busy_cpu_utilization = 1.0
            startup_timeout_seconds = 6
            python = "{wrapper}"
            [[probing.plan]]
            workload = "matmul"
            precisions = ["fp32"]
            duration_seconds = 1
            size = "small"
            interval_seconds = 3
            jitter_seconds = 0
            [drift]
            enabled = false
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUSTAIN_", "FAKENVML_"))}
    env |= {
        "LD_LIBRARY_PATH": str(fake_nvml.parent),
        "FAKENVML_SCENARIO": str(tmp_path / "faults.scn"),
    }
    port = free_port()
    log_path = tmp_path / "agent.log"
    log = log_path.open("w")
    agent = subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--config", str(tmp_path / "sustain.toml"),
         "--listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=log, env=env,
    )  # fmt: skip
    started = time.monotonic()

    def at(seconds: float) -> None:
        assert agent.poll() is None, log_path.read_text()
        time.sleep(max(0.0, seconds - (time.monotonic() - started)))
        assert agent.poll() is None, log_path.read_text()

    try:
        at(25)
        private_postgres.stop()  # while GPU 0 is lost
        at(55)
        private_postgres.start()  # after the NVML timeouts began
        at(85)
        deadline = time.monotonic() + 60
        while True:
            body = fetch(f"http://127.0.0.1:{port}/metrics", timeout=10)[1]
            if metric_sum(body, "sustain_archive_spool_items") == 0:
                break
            assert time.monotonic() < deadline, "the spool did not drain"
            time.sleep(1)
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
        log.close()
    logged = log_path.read_text()
    assert "Traceback" not in logged

    # NVML: timeouts counted, the lost GPU reported and recovered.
    assert metric_sum(body, "sustain_collector_errors_total", collector="nvml", kind="timeout") > 0
    assert metric_sum(body, "sustain_gpu_healthy", uuid=UUID0) == 1.0
    # The database outage was noticed and bridged.
    assert metric_sum(body, "sustain_archive_write_errors_total") > 0
    checker = create_engine(private_postgres.url)
    try:
        with checker.connect() as connection:
            kinds = (
                connection.execute(
                    text("SELECT kind FROM events WHERE device = :d ORDER BY occurred_at"),
                    {"d": UUID0},
                )
                .scalars()
                .all()
            )
            runs = connection.execute(
                text("SELECT outcome, reason, run_id FROM probe_runs ORDER BY started_at")
            ).all()
            periods = (
                connection.execute(
                    text(
                        "SELECT period_start FROM telemetry_rollups WHERE field = "
                        "'cpu_utilization_ratio' ORDER BY period_start"
                    )
                )
                .scalars()
                .all()
            )
    finally:
        checker.dispose()
    # The GPU's own events, in order; its health verdict followed it (issue 16).
    assert [kind for kind in kinds if kind != "health_change"][:2] == [
        "device_lost",
        "device_recovered",
    ]
    assert "health_change" in kinds
    outcomes = [outcome for outcome, _, _ in runs]
    reasons = {outcome: reason for outcome, reason, _ in runs}
    assert outcomes[1] == "failed", runs[:4]
    assert "SIGABRT" in reasons["failed"]
    assert outcomes[2] == "timeout", runs[:4]
    assert outcomes.count("ok") >= 5  # and probing went on after both
    assert outcomes.index("ok", 3) > 2
    assert len({run_id for _, _, run_id in runs}) == len(runs)
    finished = sum(1 for line in logged.splitlines() if "probe matmul" in line and " ok: " in line)
    assert outcomes.count("ok") == finished
    assert "running" not in outcomes
    assert len(periods) >= 7
    steps = {(b - a).total_seconds() for a, b in itertools.pairwise(periods)}
    assert steps == {10.0}, periods
