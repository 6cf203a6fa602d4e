"""The faults of the earlier issues together, in one run of the real agent (issue 8): a GPU lost
and back, NVML timeouts, a probe child that crashes and one that hangs, and the archive database
(a private PostgreSQL instance) stopped and started again.

The probes target the two fake GPUs; the probe interpreter is a wrapper that runs the real
workloads on the CPU, except for the second probe, which aborts (SIGABRT), and the third, which
hangs until the runner kills its process group at the timeout. The scenario runs at twice real
time (FAKENVML_TIME_SCALE), and each step waits for what the agent shows on /metrics, not for a
moment: the database stops once the GPU was seen lost and starts again once NVML timeouts were
counted and a write failed. Afterwards: the agent never died and stopped cleanly, every fault
left its trace (events, counters, outcomes with reasons), every run it finished is in the
database exactly once, and the rollups have no gap across the outage.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import PrivatePostgres, fetch, free_port
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, text

from agent.archive.database import open_engine, upgrade

UUID0 = "GPU-00000000-1111-2222-3333-444444444444"
UUID1 = "GPU-55555555-6666-7777-8888-999999999999"

TIME_SCALE = 2  # scenario seconds a real second: GPU 0 lost 10-17.5 s in, timeouts 20-25 s
SCENARIO = f"""
device 0 name "NVIDIA H100 80GB HBM3" uuid {UUID0}
device 1 name "NVIDIA H100 80GB HBM3" uuid {UUID1}
at 0 0 sm_clock_mhz 1410 power_mw 500000 reasons 0x0
at 0 1 sm_clock_mhz 1410 power_mw 500000 reasons 0x0
fault 0 lost - 20 35
fault 1 timeout nvmlDeviceGetTotalEnergyConsumption 40 50
"""

# Probe runs are counted in a file; the 2nd aborts, the 3rd starts and hangs (as a hung CUDA
# call would: its manifest, then nothing; killed at its duration and grace), the rest run on the
# CPU. (A hang before the manifest, killed at the start-up timeout, is tests/test_bounded_runs.py's:
# here the start-up timeout is long, so that no real child's torch import, slow on a loaded
# machine, runs into it.)
WRAPPER = """#!{python}
import json, os, sys, time
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
        manifest = {{"event": "manifest", "workload": "matmul", "unit": "FLOP/s"}}
        print(json.dumps(manifest), flush=True)
        time.sleep(3600)
args = ["cpu" if arg.startswith("cuda") else arg for arg in args]
os.execv({python!r}, [{python!r}, *args])
"""


# Whole rollup periods of 4 s (archive.rollup_seconds, 60 by default), sampled at 2 Hz so that no
# period of a loaded machine goes without a sample: several before, during and after the outage.
ROLLUP_SECONDS = 4
SAMPLE_SECONDS = 0.5
ERRORS = "sustain_collector_errors_total"


def metric_sum(body: str, name: str, **labels: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


@pytest.mark.slow  # end-to-end: agents, outages, faults (left out of the quick tier)
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
            [sampler]
            interval_seconds = {SAMPLE_SECONDS}
            [archive]
            database_url = "{private_postgres.url}"
            rollup_seconds = {ROLLUP_SECONDS}
            # The fleet database gets the rollups too (the default keeps them on the node), so
            # that they cross the outage through the spool.
            fleet_rollup_seconds = {ROLLUP_SECONDS}
            [probing]
            initial_delay_seconds = 0
            duty_cycle = 1.0
            busy_gpu_utilization = 1.0
            busy_cpu_utilization = 1.0
            startup_timeout_seconds = 120
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
        "FAKENVML_TIME_SCALE": str(TIME_SCALE),
    }
    port = free_port()
    log_path = tmp_path / "agent.log"
    log = log_path.open("w")
    agent = subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--config", str(tmp_path / "sustain.toml"),
         "--listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=log, env=env,
    )  # fmt: skip

    def until(what: str, check: Callable[[str], bool], seconds: float = 120) -> str:
        """/metrics once ``check`` holds for it; the agent must stay up all along."""
        deadline = time.monotonic() + seconds
        while True:
            assert agent.poll() is None, log_path.read_text()
            try:
                body = fetch(f"http://127.0.0.1:{port}/metrics", timeout=10)[1]
            except OSError:
                body = ""
            if body and check(body):
                return body
            assert time.monotonic() < deadline, f"{what} not seen in {seconds:g} s"
            time.sleep(0.5)

    def errors(kind: str) -> Callable[[str], bool]:
        return lambda body: metric_sum(body, ERRORS, collector="nvml", kind=kind) > 0

    def stored_after(moment: float) -> bool:
        checker = create_engine(private_postgres.url)
        try:
            with checker.connect() as connection:
                return bool(
                    connection.execute(
                        text(
                            "SELECT count(*) FROM telemetry_rollups WHERE field = "
                            "'cpu_utilization_ratio' AND period_start >= to_timestamp(:t)"
                        ),
                        {"t": moment},
                    ).scalar_one()
                )
        finally:
            checker.dispose()

    def runs(body: str, outcome: str, **labels: str) -> float:
        return metric_sum(body, "sustain_probe_runs_total", outcome=outcome, **labels)

    try:
        before = until("GPU 0 lost", errors("device_lost"))
        failed_writes = metric_sum(before, "sustain_archive_write_errors_total")
        outage = time.time()
        private_postgres.stop()  # while GPU 0 is lost
        # Its port stays taken while it is down (bound, not listening: connections are refused;
        # SO_REUSEADDR past the closed connections' TIME_WAIT), so that no other test's server
        # on this machine (conftest's free_port) picks it up in between.
        held = socket.socket()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", private_postgres.port))
        until("NVML timeouts", errors("timeout"))
        until(
            "a failed archive write",
            lambda b: metric_sum(b, "sustain_archive_write_errors_total") > failed_writes,
        )
        held.close()
        private_postgres.start()  # after the NVML timeouts began
        back = time.time()
        # Probing went on after the crash and the hang, on both GPUs (two ok runs each: one at
        # least after them); GPU 0 came back.
        until(
            "probing past the faults and GPU 0 back",
            lambda b: (
                runs(b, "failed") >= 1
                and runs(b, "timeout") >= 1
                and runs(b, "ok", device="0") >= 2
                and runs(b, "ok", device="1") >= 2
                and metric_sum(b, "sustain_gpu_healthy", uuid=UUID0) == 1.0
            ),
            # The hung child's timeout (duration and grace), then four ok runs one after the
            # other, on a machine the other workers load: 120 s was missed by 0.1 s once.
            seconds=300,
        )
        # A whole rollup period after the outage, then everything out of the spool.
        until("a rollup period after the outage in the database", lambda b: stored_after(back))
        body = until(
            "the spool drained", lambda b: metric_sum(b, "sustain_archive_spool_items") == 0
        )
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
        log.close()
    logged = log_path.read_text()
    assert "Traceback" not in logged

    # NVML: timeouts counted, the lost GPU reported and recovered.
    assert metric_sum(body, ERRORS, collector="nvml", kind="timeout") > 0
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
            runs_stored = connection.execute(
                text("SELECT outcome, reason, run_id, device FROM probe_runs ORDER BY started_at")
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
    # The runs that started a child, in order (a probe of the lost GPU is skipped: no child).
    ran = [(o, reason, device) for o, reason, _, device in runs_stored if o != "skipped"]
    outcomes = [outcome for outcome, _, _ in ran]
    assert outcomes[1] == "failed", ran[:4]
    assert "SIGABRT" in ran[1][1]
    assert outcomes[2] == "timeout", ran[:4]
    assert "grace" in ran[2][1], ran[2]  # killed mid-run, not at start-up
    # ... and probing went on after both, on both GPUs.
    assert {device for outcome, _, device in ran[3:] if outcome == "ok"} == {UUID0, UUID1}, ran
    assert len({run_id for _, _, run_id, _ in runs_stored}) == len(runs_stored)
    finished = sum(1 for line in logged.splitlines() if "probe matmul" in line and " ok: " in line)
    assert outcomes.count("ok") == finished
    assert "running" not in outcomes
    # Whole periods on one grid from before the outage to after it: none lost while the
    # database was down.
    steps = {(b - a).total_seconds() for a, b in itertools.pairwise(periods)}
    assert steps == {float(ROLLUP_SECONDS)}, periods
    assert periods[0].timestamp() < outage, (periods, outage)
    assert periods[-1].timestamp() >= back, (periods, back)
