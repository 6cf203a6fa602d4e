"""Faults (issue 8): kill -9 of the agent during a probe and during archive writes.

Each kill lands at a different moment of a busy agent (1 s probes back to back, rollups every
10 s, the spool draining all along), so over the rounds it hits probe children, spool appends,
drains and database transactions. After every restart the SQLite archive must pass
``PRAGMA integrity_check``, every probe the agent had finished (it logs one line per finished
run) must be in the archive exactly once, the run a kill interrupted must be recorded as
``aborted``, and the agent must go on probing.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import fetch, free_port

ROUNDS = 4


def start(home: Path, config: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUSTAIN_", "FAKENVML_"))}
    process = subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--config", str(config),
         "--listen", f"127.0.0.1:{port}", "--data-dir", str(home)],
        stdout=subprocess.DEVNULL, stderr=log.open("a"), env=env,
    )  # fmt: skip
    return process, port


def wait_for_probe(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    """Until a probe runs (sustain_probe_running 1): the kill then hits a probe. (Generous: the
    agent's start and its first child's on a machine shared with parallel workers.)"""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()
        try:
            body = fetch(f"http://127.0.0.1:{port}/metrics", timeout=2)[1]
        except OSError:
            time.sleep(0.2)
            continue
        if 'sustain_probe_running{device="cpu",uuid=""} 1.0' in body:
            return
        time.sleep(0.2)
    raise AssertionError(f"no probe started:\n{log.read_text()}")


def finished_runs(log: Path) -> int:
    return sum(
        1
        for line in log.read_text().splitlines()
        if "probe matmul" in line and " ok: " in line and "iterations" in line
    )


@pytest.mark.slow  # end-to-end: agents, outages, faults (left out of the quick tier)
def test_kill_9_during_probes_and_writes_loses_nothing(tmp_path: Path) -> None:
    config = tmp_path / "sustain.toml"
    config.write_text(
        textwrap.dedent(
            """
            [agent]
            node = "fault-node"
            [archive]
            rollup_seconds = 10
            [probing]
            initial_delay_seconds = 0
            duty_cycle = 1.0
            busy_cpu_utilization = 1.0
            preempt = false  # the suite's other processes are foreign work too
            [[probing.plan]]
            workload = "matmul"
            precisions = ["fp32"]
            duration_seconds = 1
            size = "small"
            interval_seconds = 2
            jitter_seconds = 0
            [drift]
            enabled = false
            """
        )
    )
    log = tmp_path / "agent.log"
    database = tmp_path / "sustain.db"
    for round_ in range(ROUNDS):
        process, port = start(tmp_path, config, log)
        wait_for_probe(process, port, log)
        # Vary the moment: right at the probe's start, mid-run, during its analysis and write.
        time.sleep(round_ * 0.7)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        with sqlite3.connect(database) as connection:
            assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)

    # The last start: it replays the spool, marks the interrupted runs, and carries on.
    process, port = start(tmp_path, config, log)
    try:
        wait_for_probe(process, port, log)
        before = finished_runs(log)
        deadline = time.monotonic() + 180
        while finished_runs(log) == before and time.monotonic() < deadline:
            time.sleep(0.5)
        assert finished_runs(log) > before, "the agent did not carry on probing"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    with sqlite3.connect(database) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        runs = dict(connection.execute("SELECT run_id, outcome FROM probe_runs").fetchall())
        outcomes = [row[0] for row in connection.execute("SELECT outcome FROM probe_runs")]
        series = [row[0] for row in connection.execute("SELECT run_id FROM probe_series")]
    assert len(runs) == len(outcomes)  # no run twice
    assert len(series) == len(set(series))  # no series twice
    assert set(series) <= set(runs)  # no series without its run
    # Every finished run is archived ok with its series. A run stopped part-way (a kill, the
    # final SIGTERM) keeps the iterations it had delivered as a series too, if any arrived:
    # how many did depends on the moment, so those series are not counted here.
    ok = {run_id for run_id, outcome in runs.items() if outcome == "ok"}
    assert len(ok) == finished_runs(log)
    assert ok <= set(series)
    assert "running" not in outcomes
    # Every kill hit a running probe (we waited for one); the ones it interrupted before they
    # finished are aborted. A kill can also land just after the run's end was spooled: then the
    # run is ok, which is right, and there are fewer aborted runs than kills. The final SIGTERM
    # may stop one more run (probes follow each other every 2 s): the agent records it aborted.
    assert 1 <= outcomes.count("aborted") <= ROUNDS + 1
    # A 1-s probe that the suite's other workers slow below the analysis minimum ends
    # "timeout" (insufficient), which is what happened, not a loss: seen once in a loaded run.
    assert "ok" in outcomes
    assert set(outcomes) <= {"ok", "aborted", "timeout"}
    text = log.read_text()
    assert "recorded as aborted" in text
    assert "Traceback" not in text
