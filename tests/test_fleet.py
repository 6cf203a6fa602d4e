"""Acceptance 1 of the fleet archive: a generated fleet history in PostgreSQL, read back through
the real `sustain drift` and `sustain capacity` commands.

20 nodes x 8 H100s, 60 hourly bf16 and fp32 matmul results each (1% noise). Nodes 0-9 get a driver
upgrade after result 30 that lowers bf16 (only) by 8%; node-15's GPU 3 degrades thermally by 12%
from result 40 on, without a stack change (clocks down, thermal throttling up, hotter). Drift
detection must find exactly those 80 + 2 changes with the right causes, the degraded device must
be the only fleet outlier, and the capacity medians must be numpy's over the same values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pytest
from conftest import POSTGRES_SERVER
from sqlalchemy import insert, text
from test_database_urls import forked_sustain

from agent.archive import fleet_baselines, summary
from agent.archive.database import open_engine, upgrade
from agent.archive.models import EventRecord, StackSnapshotRecord
from agent.drift.detect import fleet_outliers, load_history, outliers_by_key
from agent.health import records
from collectors.stack import StackSnapshot

# The fleet's archive is built once (a module fixture) and only read: its tests share a worker
# under pytest-xdist (--dist loadgroup), rather than each worker building its own.
pytestmark = pytest.mark.xdist_group("fleet_archive")

MODEL = "NVIDIA H100 80GB HBM3"
NODES, DEVICES, RESULTS = 20, 8, 60
UPGRADED = range(10)
UPGRADE_AT, THERMAL_AT = 30, 40
THERMAL_NODE, THERMAL_DEVICE = 15, 3
BASE = {"bf16": 700e12, "fp32": 50e12}
T0 = datetime(2026, 11, 1, tzinfo=UTC)


def stack(driver: str) -> StackSnapshot:
    return StackSnapshot(
        {
            "driver": {"version": driver, "cuda_version": "12.4", "nvml_version": "12." + driver},
            "gpus": [{"model": MODEL, "vbios": "96.00.99.00.01"}] * DEVICES,
            "torch": {"version": "2.5.1", "cuda": "12.4", "cudnn": 90100, "nccl": "2.21.5"},
            "host": {"kernel": "6.8.0-45-generic", "python": "3.11.7"},
        }
    )


OLD, NEW = stack("550.54.15"), stack("555.42.02")


def fleet() -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    rng = np.random.default_rng(20261122)
    rows: list[dict[str, Any]] = []
    values: dict[str, list[float]] = {"bf16": [], "fp32": []}
    for node in range(NODES):
        for device in range(DEVICES):
            for index in range(RESULTS):
                upgraded = node in UPGRADED and index >= UPGRADE_AT
                hot = (node, device) == (THERMAL_NODE, THERMAL_DEVICE) and index >= THERMAL_AT
                for precision, base in BASE.items():
                    factor = 1.0
                    if upgraded and precision == "bf16":
                        factor *= 0.92
                    if hot:
                        factor *= 0.88
                    steady = base * factor * (1 + 0.01 * rng.standard_normal())
                    values[precision].append(steady)
                    ended = T0 + timedelta(hours=index, minutes=node)
                    rows.append(
                        {
                            "run_id": uuid.uuid4().hex,
                            "node": f"node-{node:02d}",
                            "device": f"GPU-{node:02d}-{device}",
                            "device_label": str(device),
                            "device_model": MODEL,
                            "stack_id": (NEW if upgraded else OLD).id,
                            "workload": "matmul",
                            "precision": precision,
                            "optimization": "eager",
                            "outcome": "ok",
                            "reason": "",
                            "started_at": ended - timedelta(seconds=20),
                            "ended_at": ended,
                            "duration_seconds": 20.0,
                            "iterations": 200,
                            "throughput": steady,
                            "unit": "FLOP/s",
                            "stderr_tail": "",
                            "classification": "steady",
                            "peak_throughput": steady * 1.02,
                            "steady_throughput": steady,
                            "sustained_ratio": 1 / 1.02,
                            "steady_sm_clock_hertz": (1.74e9 if hot else 1.98e9)
                            * (1 + 0.002 * rng.standard_normal()),
                            "steady_temperature_celsius": (87.0 if hot else 70.0)
                            + rng.standard_normal(),
                            "steady_power_watts": 690.0,
                            "steady_thermal_share": 0.6 if hot else 0.0,
                            "steady_power_share": 0.0,
                        }
                    )
    return rows, values


@pytest.fixture(scope="module")
def fleet_url(postgres_admin: Any) -> Any:
    name = f"sustain_fleet_{uuid.uuid4().hex[:12]}"
    with postgres_admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    url = f"{POSTGRES_SERVER}/{name}"
    engine = open_engine(url)
    upgrade(engine)
    rows, values = fleet()
    with engine.begin() as connection:
        # A bulk load as bench/fleet_results.py makes one: COPY with the summary's trigger off
        # (it costs about a millisecond a row), then the summary recomputed from the runs at
        # once, which is what the trigger would have kept (tests/test_fleet_scale.py compares
        # the two). The runs' columns are all plain values (aware datetimes for timestamptz).
        connection.exec_driver_sql("SET LOCAL session_replication_role = replica")
        for snapshot, seen in ((OLD, T0), (NEW, T0 + timedelta(hours=UPGRADE_AT))):
            connection.execute(
                insert(StackSnapshotRecord).values(
                    stack_id=snapshot.id,
                    facts=snapshot.canonical_json(),
                    driver_version=snapshot.facts["driver"]["version"],
                    first_seen_at=seen,
                )
            )
        columns = list(rows[0])
        raw = connection.connection.driver_connection  # psycopg's: COPY, not 19,200 INSERTs
        assert raw is not None
        with (
            raw.cursor() as cursor,
            cursor.copy(f"COPY probe_runs ({', '.join(columns)}) FROM STDIN") as copy,
        ):
            for row in rows:
                copy.write_row([row[column] for column in columns])
        connection.execute(
            insert(EventRecord),
            [
                {
                    "event_id": uuid.uuid4().hex,
                    "node": f"node-{node:02d}",
                    "device": "node",
                    "kind": "stack_changed",
                    "occurred_at": T0 + timedelta(hours=UPGRADE_AT),
                    "message": "stack changed",
                    "attributes": json.dumps(
                        {"new": NEW.id, "old": OLD.id, "summary": "driver.version ..."}
                    ),
                }
                for node in UPGRADED
            ],
        )
        connection.exec_driver_sql("SET LOCAL session_replication_role = DEFAULT")
        summary.rebuild(connection)
    engine.dispose()
    yield url, values
    with postgres_admin.connect() as connection:
        connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def sustain(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m agent ARGS`, forked from tests/test_database_urls.py's zygote."""
    return forked_sustain(args, os.environ, timeout=300)


def test_drift_finds_exactly_the_upgrade_and_the_thermal_device(fleet_url: Any) -> None:
    url, _ = fleet_url
    done = sustain("drift", "--database", url, "--json")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    drifts = answer["drifts"]
    stack_changes = [d for d in drifts if d["cause"] == "stack"]
    thermal = [d for d in drifts if d["cause"] == "thermal"]
    assert len(drifts) == len(stack_changes) + len(thermal) == 80 + 2
    upgraded = {(f"node-{n:02d}", f"GPU-{n:02d}-{d}") for n in UPGRADED for d in range(DEVICES)}
    assert {(d["node"], d["device"]) for d in stack_changes} == upgraded
    for drift in stack_changes:
        assert drift["precision"] == "bf16"
        assert drift["direction"] == "regression"
        assert drift["change"] == pytest.approx(-0.08, abs=0.01)
        first_after = T0 + timedelta(hours=UPGRADE_AT, minutes=int(drift["node"][5:]))
        assert datetime.fromisoformat(drift["at"]) == first_after
        assert "driver.version 550.54.15 -> 555.42.02" in drift["explanation"]
        assert (drift["stack_before"], drift["stack_after"]) == (OLD.id, NEW.id)
    hot = f"GPU-{THERMAL_NODE}-{THERMAL_DEVICE}"
    assert sorted((d["device"], d["precision"]) for d in thermal) == [
        (hot, "bf16"),
        (hot, "fp32"),
    ]
    for drift in thermal:
        assert drift["change"] == pytest.approx(-0.12, abs=0.01)
        assert "thermal throttling 0% -> 60%" in drift["explanation"]
        assert drift["stack_before"] == drift["stack_after"] == OLD.id
    outliers = answer["outliers"]
    assert sorted((o["device"], o["precision"]) for o in outliers) == [
        (hot, "bf16"),
        (hot, "fp32"),
    ]
    assert all(o["ratio"] == pytest.approx(0.88, abs=0.015) for o in outliers)


def test_every_node_reads_the_fleets_answers_by_key(fleet_url: Any) -> None:
    """Issue 28: the fleet's pass once, then each node's outliers from a row per group and its
    own results equal the outliers computed from the whole fleet's history (every field, to
    the last bit), and so do the health baselines against the peers' rows."""
    url, _ = fleet_url
    engine = open_engine(url)
    end = T0 + timedelta(hours=RESULTS, minutes=NODES)
    since = T0 - timedelta(hours=1)
    try:
        with engine.begin() as connection:
            written = fleet_baselines.refresh(connection, cutoff=end, since=since)
        # Per outlier group (model, stack, probe) and health identity (and size): bf16 and fp32
        # on the old stack and the new.
        assert written == 4 + 4
        history = load_history(engine)
        flagged = []
        for node in range(NODES):
            name = f"node-{node:02d}"
            own = load_history(engine, node=name)
            assert own == {key: results for key, results in history.items() if key[0] == name}
            by_key = outliers_by_key(engine, own, 0.10)
            assert by_key == fleet_outliers(history, 0.10, node=name)
            assert len(by_key) == DEVICES * len(BASE)
            flagged += [(o.device, o.precision) for o in by_key if o.outlier]
        hot = f"GPU-{THERMAL_NODE}-{THERMAL_DEVICE}"
        assert sorted(flagged) == [(hot, "bf16"), (hot, "fp32")]

        for node, device in ((0, 0), (9, 7), (10, 1), (THERMAL_NODE, THERMAL_DEVICE)):
            for precision in BASE:
                for snapshot in (OLD, NEW):
                    identity = records.ProbeIdentity(
                        "matmul", precision, "eager", "default", MODEL, snapshot.id
                    )
                    args = (identity, f"node-{node:02d}", f"GPU-{node:02d}-{device}")
                    expected = records.baseline_from_peers(engine, *args, since.timestamp())
                    assert records.baseline(engine, *args, 0.0) == expected, args
                    # Every device ran the old stack first; a device that never ran the new
                    # one is not among its group's members, and has them all as peers.
                    upgraded = node in UPGRADED
                    assert expected.peers == (
                        len(UPGRADED) * DEVICES - upgraded
                        if snapshot is NEW
                        else NODES * DEVICES - 1
                    )
    finally:
        engine.dispose()


def test_a_nodes_drift_child_makes_the_fleets_pass_once_and_reads_by_key(fleet_url: Any) -> None:
    """The daemon's child (`python -m agent.drift.detect`) on a fleet's database: the first
    finds the pass due and makes it, the next finds it fresh; each answers its node's drifts,
    and outliers equal to those from the whole fleet's history."""
    url, _ = fleet_url
    node = f"node-{THERMAL_NODE:02d}"
    request = {
        "database_url": url,
        "node": node,
        "window": 50,
        "max_pvalue": 0.001,
        "min_magnitude": 0.03,
        "history": 500,
        "outlier_ratio": 0.10,
        "interval_seconds": 3600.0,
        "baseline_days": 7.0,
    }

    def child() -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, "-m", "agent.drift.detect"],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return dict(json.loads(done.stdout))

    def last_pass() -> datetime:
        with engine.connect() as connection:
            made = connection.execute(text("SELECT max(cutoff) FROM fleet_baselines")).scalar_one()
        assert isinstance(made, datetime)
        return made

    engine = open_engine(url)
    try:
        before = datetime.now(UTC)
        answer = child()
        made = last_pass()
        assert made >= before - timedelta(seconds=1)
        expected = fleet_outliers(load_history(engine), 0.10, node=node)
        assert answer["outliers"] == json.loads(json.dumps([o.as_dict() for o in expected]))
        assert sum(o["outlier"] for o in answer["outliers"]) == len(BASE)
        assert sorted(d["cause"] for d in answer["drifts"]) == ["thermal", "thermal"]
        assert child()["outliers"] == answer["outliers"]
        assert last_pass() == made  # fresh: not made again within the period
    finally:
        engine.dispose()


def test_drift_since_and_node_narrow_the_report(fleet_url: Any) -> None:
    url, _ = fleet_url
    later = (T0 + timedelta(hours=THERMAL_AT - 1)).isoformat()
    done = sustain("drift", "--database", url, "--since", later, "--json")
    assert done.returncode == 0, done.stderr
    assert {d["cause"] for d in json.loads(done.stdout)["drifts"]} == {"thermal"}
    done = sustain("drift", "--database", url, "--node", "node-03")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "8 change(s) in sustained throughput"
    assert all("stack" in line and "driver.version" in line for line in lines[1:9])
    assert lines[9].startswith("0 fleet outlier(s)")


def test_capacity_by_model_matches_the_expected_medians(fleet_url: Any) -> None:
    url, values = fleet_url
    done = sustain("capacity", "--database", url, "--by", "model", "--precision", "bf16", "--json")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    (row,) = answer["rows"]
    assert answer["runs"]["used"] == {"steady": row["results"], "p10": 0}
    assert row["basis"] == "steady"
    assert row["group"] == MODEL
    assert row["results"] == NODES * DEVICES * RESULTS
    assert row["devices"] == NODES * DEVICES
    assert row["median"] == pytest.approx(float(np.median(values["bf16"])), rel=1e-9)
    assert row["p10"] == pytest.approx(float(np.percentile(values["bf16"], 10)), rel=1e-9)
    # A quarter of the bf16 results run 8% slower after the upgrade: the median sits just under
    # the healthy level, the p10 among the upgraded results.
    assert 0.97 * BASE["bf16"] < row["median"] < BASE["bf16"]
    assert row["p10"] == pytest.approx(0.92 * BASE["bf16"], rel=0.02)
    done = sustain("capacity", "--database", url, "--by", "stack", "--precision", "bf16")
    assert done.returncode == 0, done.stderr
    assert OLD.id[:12] in done.stdout
    assert NEW.id[:12] in done.stdout


def test_stack_history_and_diff_from_the_fleet_archive(fleet_url: Any) -> None:
    url, _ = fleet_url
    done = sustain("stack", "history", "--database", url, "--node", "node-02")
    assert done.returncode == 0, done.stderr
    assert f"node-02  {OLD.id[:12]} -> {NEW.id[:12]}" in done.stdout
    done = sustain("stack", "diff", OLD.id[:8], NEW.id[:8], "--database", url)
    assert done.returncode == 0, done.stderr
    assert "driver.version: 550.54.15 -> 555.42.02" in done.stdout
    assert "driver.nvml_version: 12.550.54.15 -> 12.555.42.02" in done.stdout
    done = sustain("stack", "diff", "ffff", NEW.id, "--database", url)
    assert done.returncode == 2
    assert done.stderr.strip() == "sustain: error: no stack ffff in the archive"
