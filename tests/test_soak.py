"""Soak, accelerated (issue 8): the fake NVML driver at a time scale of 60 for 10 minutes, that is
10 scenario hours of two H100s with throttle episodes (GPU 1 in HW thermal slowdown for 10
scenario minutes every hour, GPU 0 under power brake for 5 minutes every two hours) and a driver
upgrade halfway. The agent samples at 1 Hz, rolls up every 10 s and reads its stack every 10 s.

Afterwards: its memory grew by less than 10 MB after a two-minute warm-up, the archived rollups
have no gap, every throttle episode that ended is one archive event, and the upgrade is one
stack change. Marked slow (10 minutes); it runs in CI all the same.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import fetch, free_port
from prometheus_client.parser import text_string_to_metric_families

SCALE = 60.0
REAL_SECONDS = 600.0
WARMUP_SECONDS = 120.0
UUID0 = "GPU-00000000-1111-2222-3333-444444444444"
UUID1 = "GPU-55555555-6666-7777-8888-999999999999"


def scenario() -> tuple[str, list[tuple[str, str, int, int]]]:
    """The scenario text and its episodes: (uuid, reason, start, end) in scenario seconds."""
    lines = [
        "set driver_version 550.54.15",
        'device 0 name "NVIDIA H100 80GB HBM3" uuid ' + UUID0,
        'device 1 name "NVIDIA H100 80GB HBM3" uuid ' + UUID1,
        "upgrade 18000 555.42.02",
    ]
    for d in (0, 1):
        lines.append(f"device {d} max_sm_clock_mhz 1980 power_limit_mw 700000 slowdown_temp_c 87")
        lines.append(f"at 0 {d} sm_clock_mhz 1410 power_mw 600000 gpu_temp_c 70 reasons 0x0")
    episodes = []
    for hour in range(10):
        start = hour * 3600 + 1200
        episodes.append((UUID1, "hw_thermal_slowdown", start, start + 600))
        lines.append(f"at {start} 1 reasons 0x40 sm_clock_mhz 1100 gpu_temp_c 88")
        lines.append(f"at {start + 600} 1 reasons 0x0 sm_clock_mhz 1410 gpu_temp_c 70")
        if hour % 2 == 0:
            start = hour * 3600 + 2400
            episodes.append((UUID0, "hw_power_brake_slowdown", start, start + 300))
            lines.append(f"at {start} 0 reasons 0x80 sm_clock_mhz 900")
            lines.append(f"at {start + 300} 0 reasons 0x0 sm_clock_mhz 1410")
    return "\n".join(lines) + "\n", episodes


def rss(port: int) -> float:
    body = fetch(f"http://127.0.0.1:{port}/metrics", timeout=10)[1]
    for family in text_string_to_metric_families(body):
        if family.name == "sustain_process_resident_memory_bytes":
            return family.samples[0].value
    raise AssertionError("no sustain_process_resident_memory_bytes")


@pytest.mark.slow
@pytest.mark.timeout(REAL_SECONDS + 300)
def test_ten_scenario_hours_in_ten_minutes(fake_nvml: Path, tmp_path: Path) -> None:
    text, episodes = scenario()
    (tmp_path / "soak.scn").write_text(text)
    (tmp_path / "sustain.toml").write_text(
        textwrap.dedent(
            """
            [agent]
            node = "soak-node"
            [archive]
            rollup_seconds = 10
            [stack]
            interval_seconds = 10
            [probing]
            enabled = false
            [drift]
            enabled = false
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUSTAIN_", "FAKENVML_"))}
    env |= {
        "LD_LIBRARY_PATH": str(fake_nvml.parent),
        "FAKENVML_SCENARIO": str(tmp_path / "soak.scn"),
        "FAKENVML_TIME_SCALE": str(SCALE),
    }
    port = free_port()
    log = (tmp_path / "agent.log").open("w")
    agent = subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--config", str(tmp_path / "sustain.toml"),
         "--listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=log, env=env,
    )  # fmt: skip
    started = time.monotonic()
    memory: list[tuple[float, float]] = []
    try:
        while (elapsed := time.monotonic() - started) < REAL_SECONDS:
            assert agent.poll() is None, (tmp_path / "agent.log").read_text()
            if elapsed >= WARMUP_SECONDS:
                memory.append((elapsed, rss(port)))
            time.sleep(15)
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
        log.close()
    scenario_end = (time.monotonic() - started) * SCALE

    growth = max(value for _, value in memory) - memory[0][1]
    assert growth < 10 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB after warm-up: {memory}"

    with sqlite3.connect(tmp_path / "sustain.db") as connection:
        rollups = {
            device: [
                row[0]
                for row in connection.execute(
                    "SELECT period_start FROM telemetry_rollups WHERE device = ? AND "
                    "field = 'gpu_power_watts' ORDER BY period_start",
                    (device,),
                )
            ]
            for device in (UUID0, UUID1)
        }
        events = connection.execute(
            "SELECT device, attributes FROM events WHERE kind = 'throttle_episode'"
        ).fetchall()
        changes = connection.execute(
            "SELECT attributes FROM events WHERE kind = 'stack_changed' ORDER BY occurred_at"
        ).fetchall()
    for device, periods in rollups.items():
        # About 60 periods of 10 s; none missing between the first and the last.
        assert len(periods) >= 55, (device, len(periods))
        starts = [time.mktime(time.strptime(p[:19], "%Y-%m-%d %H:%M:%S")) for p in periods]
        assert {b - a for a, b in itertools.pairwise(starts)} == {10.0}, device

    ended = Counter(
        (uuid, reason) for uuid, reason, _, end in episodes if end < scenario_end - SCALE
    )
    seen = Counter((device, json.loads(attrs)["reason"]) for device, attrs in events)
    assert sum(ended.values()) == 15  # every episode of the scenario had ended before the stop
    assert not ended - seen, f"episodes without an event: {ended - seen}"
    assert sum((seen - ended).values()) == 0, f"events without an episode: {seen - ended}"
    for _, attrs in events:
        length = float(json.loads(attrs)["seconds"]) * SCALE
        assert length == pytest.approx(
            600 if json.loads(attrs)["reason"] == "hw_thermal_slowdown" else 300, abs=2 * SCALE
        )

    summaries = [json.loads(row[0])["summary"] for row in changes]
    assert len(summaries) == 2, summaries  # the first stack, then the upgrade
    assert "driver.version 550.54.15 -> 555.42.02" in summaries[1]
