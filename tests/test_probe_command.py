"""`sustain probe` as a new user meets it on a CPU-only node: the answer (peak, steady with its
interval, sustained ratio, warm-up, classification, cause, windowed p10/p50) in 80 columns and in
JSON, `--record` feeding `sustain capacity`, and a restarted agent showing the archived results
on /metrics before its first probe. Real subprocesses throughout; the probes run on this CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import start_agent
from prometheus_client.parser import text_string_to_metric_families

LABELS = ("peak", "steady", "sustained", "warm-up", "windows", "class", "cause")
STEADY_CLASSES = ("flat", "warmup", "slowdown")


def sustain(
    *args: str, columns: int | None = 80, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUSTAIN_", "COLUMNS"))}
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return subprocess.run(
        [sys.executable, "-m", "agent", *args],
        capture_output=True,  # no terminal: what a pipe or a log file gets
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


PROBE = (
    "probe",
    "--workload",
    "matmul",
    "--precision",
    "fp32",
    "--duration",
    "10",
    "--device",
    "cpu",
    # The default size, which the workload shrinks until the analysis minimum fits the duration:
    # the tiny "small" matmul is at the mercy of every other process on two cores.
    "--force",  # the suite's own load must not skip it; the busy check is tested elsewhere
)


@pytest.mark.parametrize("columns", [80, None])
def test_probe_shows_the_answer_in_80_columns(tmp_path: Path, columns: int | None) -> None:
    done = sustain(*PROBE, "--data-dir", str(tmp_path), columns=columns)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("matmul fp32 eager on cpu: ok, ")
    assert max(len(line) for line in lines) <= 80, done.stdout
    labels = [line.split()[0] for line in lines[1:] if line.startswith("  ") and line.strip()]
    for label in LABELS:
        assert label in labels, done.stdout
    text = " ".join(done.stdout.split())
    assert "FLOP/s" in text
    assert "p10 " in text
    assert "p50 " in text
    assert "over 1-second windows" in text
    classification = next(line for line in lines if line.startswith("  class")).split()[1]
    if classification.rstrip(":") in STEADY_CLASSES:
        assert "99% interval" in text
        assert "of peak (steady / peak)" in text


def test_probe_json_carries_every_figure(tmp_path: Path) -> None:
    done = sustain(*PROBE, "--json", "--data-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    (run,) = json.loads(done.stdout)["runs"]
    for key in (
        "classification",
        "classification_reason",
        "peak",
        "steady",
        "steady_ci99",
        "sustained_ratio",
        "warmup_seconds",
        "p10",
        "p50",
        "window_seconds",
        "cause",
        "cause_reason",
    ):
        assert key in run, key
    assert run["outcome"] == "ok"
    assert run["unit"] == "FLOP/s"
    assert run["window_seconds"] == 1.0
    assert 0 < run["p10"] <= run["p50"]
    if run["classification"] in STEADY_CLASSES:
        low, high = run["steady_ci99"]
        assert low <= run["steady"] <= high
        assert run["sustained_ratio"] == pytest.approx(run["steady"] / run["peak"])


def recorded_steady_run(tmp_path: Path) -> dict[str, Any]:
    """`sustain probe --record` until one run has a steady state (at most three tries: a run the
    suite's own load keeps from settling is honest, but records nothing for capacity)."""
    for _ in range(3):
        done = sustain(*PROBE, "--json", "--record", "--data-dir", str(tmp_path))
        assert done.returncode == 0, done.stderr
        document = json.loads(done.stdout)
        assert document["recorded"] is True
        (run,) = document["runs"]
        if run["classification"] in STEADY_CLASSES:
            return dict(run)
    pytest.fail("no steady run in three tries")


def test_recorded_run_is_in_capacity_and_restored_after_a_restart(tmp_path: Path) -> None:
    assert not (tmp_path / "sustain.db").exists()
    run = recorded_steady_run(tmp_path)
    database = f"sqlite:///{tmp_path / 'sustain.db'}"
    capacity = sustain("capacity", "--database", database, "--json")
    assert capacity.returncode == 0, capacity.stderr
    rows = json.loads(capacity.stdout)
    matmul = [row for row in rows if row["workload"] == "matmul" and row["precision"] == "fp32"]
    assert matmul, rows
    assert matmul[0]["results"] >= 1

    agent = start_agent(tmp_path, env={"SUSTAIN_PROBING__ENABLED": "false"})
    try:
        body = agent.wait_for('stat="steady"', timeout=30)
    finally:
        agent.terminate()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == "sustain_probe_flops" and sample.labels["workload"] == "matmul":
                values[sample.labels["stat"]] = sample.value
    assert set(values) >= {"peak", "steady", "p10", "p50"}
    assert values["peak"] == pytest.approx(run["peak"])
    assert values["p10"] == pytest.approx(run["p10"])
