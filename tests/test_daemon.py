"""The daemon end to end, as an operator runs it: a real `sustain run` process, real sockets, a
real SQLite file, signals. Host metrics come from the real /proc and /sys of this machine, or from
the fixture tree where a test needs every family to be present."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from conftest import Running, fetch, free_port, start_agent
from prometheus_client.parser import text_string_to_metric_families

FIXTURES = Path(__file__).parent / "fixtures" / "host"


def run_to_exit(*args: str) -> subprocess.CompletedProcess[str]:
    """`sustain run ARGS` for a case that must end by itself (a start-up error)."""
    return subprocess.run(
        [sys.executable, "-m", "agent", "run", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# A stop is a few seconds' work (loops joined, the last rollups written, the spool drained): one
# that waited for a running job or child would take that job's time, minutes or hours.
STOP_SECONDS = 15.0
# How long a test gives an agent to start and answer: seconds on a quiet machine, many more on one
# shared with parallel workers and a busy core.
STARTUP_SECONDS = 120.0


def ready(running: Running) -> str:
    """``running.wait_ready()`` (host metrics served) with a deadline a loaded machine keeps."""
    return running.wait_for("sustain_cpu_utilization_ratio ", timeout=STARTUP_SECONDS)


def quick_probe_python(directory: Path) -> Path:
    """A stand-in probe interpreter for an agent whose test is about neither probes nor the
    stack: it answers the stack's ``-m workloads facts`` at once, with no torch facts (as a
    child without torch would), where the real child imports torch, about 2 s of CPU at every
    start of an agent, which a stop right after the start then waits for. The real child's facts
    are tests/test_stack.py's business."""
    path = directory / "quick-python"
    path.write_text("#!/bin/sh\necho '{}'\n")
    path.chmod(0o755)
    return path


def quick_env(directory: Path, **env: str) -> dict[str, str]:
    """``env`` and the stand-in probe interpreter, for ``start_agent``."""
    return {"SUSTAIN_PROBING__PYTHON": str(quick_probe_python(directory)), **env}


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Running]:
    running = start_agent(tmp_path, env=quick_env(tmp_path))
    yield running
    if running.process.poll() is None:
        running.process.kill()
        running.process.communicate()


def families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def test_serves_host_metrics_in_base_units_and_stops_on_sigterm(agent: Running) -> None:
    metrics = families(ready(agent))
    ((_, utilization),) = metrics["sustain_cpu_utilization_ratio"]
    assert 0.0 <= utilization <= 1.0
    frequencies = metrics["sustain_cpu_frequency_hertz"]
    assert len(frequencies) == os.cpu_count()
    assert all(1e8 < value < 1e10 for _, value in frequencies)  # hertz, not MHz
    ((_, total),) = metrics["sustain_memory_total_bytes"]
    assert total > 2**30  # bytes, not kB
    # No NVIDIA driver here: the NVML collector reports itself absent and the agent runs on.
    assert metrics["sustain_collector_up"] == [({"collector": "host"}, 1.0)]
    assert metrics["sustain_collector_absent"] == [
        ({"collector": "nvml", "reason": "library_not_found"}, 1.0)
    ]
    ((labels, _),) = metrics["sustain_build_info"]
    assert labels["version"]

    status, body = fetch(agent.base + "/healthz")
    assert (status, body) == (200, "ok\n")
    status, body = fetch(agent.base + "/")
    assert status == 200
    assert '<a href="/metrics">' in body
    assert fetch(agent.base + "/nope")[0] == 404

    code, seconds, err = agent.terminate()
    assert code == 0, err
    assert seconds < STOP_SECONDS
    assert "Traceback" not in err
    assert err.count("NVML unavailable") == 1, err  # one line, not one per poll


ROLLUP_SECONDS = 2  # archive.rollup_seconds (60 by default): whole periods in seconds
SAMPLE_SECONDS = 0.2  # sampler.interval_seconds: ten polls a period, as 1 Hz gives a 10 s one


@pytest.mark.slow
def test_rollups_one_row_per_series_per_whole_period(tmp_path: Path) -> None:
    """Runs about 4 rollup periods of 2 s, sampled at 5 Hz: acceptance 3 and 5 with a shorter
    period (the daemon's clock is the wall clock; the period and the interval are settings)."""
    launched = time.time()
    agent = start_agent(
        tmp_path,
        env=quick_env(
            tmp_path,
            SUSTAIN_ARCHIVE__ROLLUP_SECONDS=str(ROLLUP_SECONDS),
            SUSTAIN_SAMPLER__INTERVAL_SECONDS=str(SAMPLE_SECONDS),
        ),
    )
    try:
        ready(agent)
        answered = time.time()
        time.sleep(4 * ROLLUP_SECONDS)
        signalled = time.time()
        code, seconds, err = agent.terminate()
        exited = time.time()
    finally:
        if agent.process.poll() is None:
            agent.process.kill()
            agent.process.communicate()
    assert code == 0, err
    assert seconds < STOP_SECONDS

    with sqlite3.connect(agent.data_dir / "sustain.db") as db:
        rows = db.execute(
            "SELECT field, labels, period_start, period_seconds, sample_count "
            "FROM telemetry_rollups"
        ).fetchall()
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    periods: dict[str, set[tuple[str, str]]] = {}
    for field, labels, period_start, period_seconds, sample_count in rows:
        assert period_seconds == ROLLUP_SECONDS
        assert 1 <= sample_count <= ROLLUP_SECONDS / SAMPLE_SECONDS + 1
        periods.setdefault(str(period_start), set()).add((field, labels))

    # Whole periods only: none before the agent started, none still open when it stopped. The
    # agent started between the launch and its first answer, and stopped between the signal and
    # its exit: the whole periods it saw are at least those within [answered, signalled] and at
    # most those within [launched, exited], whatever the machine's load made of those moments.
    def whole(begin: float, end: float) -> int:
        return max(0, int(end // ROLLUP_SECONDS) - int(begin // ROLLUP_SECONDS) - 1)

    least, most = whole(answered, signalled), whole(launched, exited)
    # On a loaded machine the last period may not reach the database within the stop's drain
    # time: it then waits in the spool for the next start, and the log says so (nothing lost).
    if "stay in the spool" in err:
        least -= 1
    assert least >= 2
    assert least <= len(periods) <= most, (sorted(periods), least, most, err[-2000:])
    starts = sorted(datetime.fromisoformat(start) for start in periods)
    steps = {(b - a).total_seconds() for a, b in itertools.pairwise(starts)}
    assert steps == {ROLLUP_SECONDS}, starts  # no gap
    series_sets = list(periods.values())
    assert all(series == series_sets[0] for series in series_sets), "a series missed a period"
    fields = {field for field, _ in series_sets[0]}
    assert {"cpu_utilization_ratio", "memory_used_bytes", "load1"} <= fields
    assert "cpu_core_utilization_ratio" not in fields  # per-core series are not archived


def test_healthz_and_metrics_with_fixture_tree(tmp_path: Path) -> None:
    running = start_agent(
        tmp_path,
        env=quick_env(
            tmp_path,
            SUSTAIN_HOST__PROCFS=str(FIXTURES / "proc"),
            SUSTAIN_HOST__SYSFS=str(FIXTURES / "sys"),
        ),
    )
    try:
        body = running.wait_for("sustain_rapl_energy_joules_total", timeout=STARTUP_SECONDS)
        metrics = families(body)
        zones = {labels["zone"] for labels, _ in metrics["sustain_rapl_energy_joules_total"]}
        assert "package-0" in zones
        assert metrics["sustain_temperature_celsius"]
    finally:
        code, _, err = running.terminate()
    assert code == 0, err


def test_sigint_stops_like_sigterm(agent: Running) -> None:
    ready(agent)
    code, seconds, err = agent.terminate(signal.SIGINT)
    assert (code, "received SIGINT" in err, "Traceback" in err) == (0, True, False), err
    assert seconds < STOP_SECONDS


def test_port_in_use_is_one_line_exit_2(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = run_to_exit("--listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path))
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert lines == [f"sustain: error: cannot listen on 127.0.0.1:{port}: Address already in use"]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("database", "expected"),
    [
        ("unwritable", "cannot"),
        # An unreachable server is no configuration error any more: the agent starts and retries
        # (tests/test_archive_failsafe.py); a URL no driver can serve, or of a database the
        # archive does not run on, still exits 2.
        ("postgresql+nosuchdriver://sustain:s3cret@127.0.0.1:1/x", "unknown database driver"),
        ("mysql://sustain:s3cret@127.0.0.1:1/x", "unsupported database 'mysql'"),
    ],
)
def test_database_startup_errors_are_one_line_exit_2(
    tmp_path: Path, database: str, expected: str
) -> None:
    if database == "unwritable":
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        database = f"sqlite:///{blocker}/sub/sustain.db"  # parent is a file: cannot be created
    result = run_to_exit(
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--database",
        database,
        "--data-dir",
        str(tmp_path / "data"),
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr  # nothing logged before the error
    errors = [line for line in result.stderr.splitlines() if line.startswith("sustain: ")]
    assert len(errors) == 1, result.stderr
    assert expected in errors[0]
    assert "s3cret" not in result.stderr
    assert "Traceback" not in result.stderr
