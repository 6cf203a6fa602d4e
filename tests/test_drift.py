"""Drift detection reads solo runs only, on SQLite and PostgreSQL.

A node-wide run (every device of the node at once) sustains less than the same device alone:
that is coupling, reported by the node-wide figures, and never a change in the device. The same
figures archived as solo runs are a regression, which shows the series would have been caught.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import numpy as np
from sqlalchemy import Engine
from test_capacity import NOW, probe_run, store

from agent.drift.detect import detect, fleet_outliers, load_history, stack_facts

RUNS = 60
SOLO = 7.0e14
NODE_WIDE = 0.6 * SOLO


def history(scope: str) -> list[dict[str, Any]]:
    """GPU-0's hourly bf16 matmul results: 60 solo ones at 1% noise, and from the 30th on a
    result at 60% of them every hour as well, archived with ``scope``."""
    rng = np.random.default_rng(15)
    rows = []
    for index in range(RUNS):
        at = NOW - timedelta(hours=RUNS - index)
        rows.append(
            probe_run(
                started_at=at,
                scope="device",  # one insert takes its columns from its first row
                steady_throughput=float(SOLO * (1 + 0.01 * rng.standard_normal())),
            )
        )
        if index >= RUNS // 2:
            rows.append(
                probe_run(
                    started_at=at + timedelta(minutes=30),
                    scope=scope,
                    group_id=f"{index:032d}",
                    steady_throughput=float(NODE_WIDE * (1 + 0.01 * rng.standard_normal())),
                )
            )
    return rows


def drifts(engine: Engine) -> list[Any]:
    found = load_history(engine)
    facts = stack_facts(engine, (r.stack_id for results in found.values() for r in results))
    return detect(found, facts)


def test_a_node_wide_run_slower_than_solo_is_no_drift(archive_engine: Engine) -> None:
    store(archive_engine, history("node"))
    found = load_history(archive_engine)
    assert [len(results) for results in found.values()] == [RUNS]
    assert all(r.steady > 0.9 * SOLO for results in found.values() for r in results)
    assert drifts(archive_engine) == []
    assert not any(o.outlier for o in fleet_outliers(found))


def test_the_same_figures_as_solo_runs_are_a_drift(archive_engine: Engine) -> None:
    store(archive_engine, history("device"))
    assert [d.direction for d in drifts(archive_engine)] == ["regression"]
