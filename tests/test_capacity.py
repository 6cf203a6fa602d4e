"""``agent.reports.capacity`` against numpy on the same values, on SQLite and PostgreSQL.

The rows are written straight into probe_runs, as the agent's writer leaves them, and read back
through the probe_results view (the steady basis) and the partial indexes of the p10 basis and of
the runs left out; every expectation is computed here from the same list with numpy.
"""

from __future__ import annotations

import json
import re
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import Engine, event, insert, select

from agent.archive.database import ArchiveError, open_engine, upgrade
from agent.archive.models import ProbeRunRecord
from agent.archive.probe_runs import ProbeRunWriter
from agent.probes.runner import CPU, ProbeRun, ProbeSpec
from agent.reports import capacity as capacity_module
from agent.reports.capacity import (
    BASES,
    LEFT_OUT_REASONS,
    SCOPES,
    CapacityRow,
    RunsCounted,
    capacity,
    capacity_with_runs,
    parse_since,
)
from agent.reports.capacity_output import (
    capacity_as_json,
    human,
    render_runs,
    render_table,
    rows_as_json,
)
from agent.reports.specs import spec_peak

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)
H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
UNKNOWN = "NVIDIA Mystery 9000"
STACK_A = "a" * 64
STACK_B = "b" * 64
GROUP_COLUMN = {"model": "device_model", "node": "node", "stack": "stack_id"}
COLUMNS = ["SIZE", "SCOPE", "MEDIAN", "P10", "SPEC", "RESULTS", "DEVICES"]  # after the group's


def probe_run(**values: Any) -> dict[str, Any]:
    """A row of probe_runs: an ok, analysed run unless ``values`` say otherwise."""
    started_at = values.pop("started_at", NOW - timedelta(hours=1))
    row: dict[str, Any] = {
        "run_id": uuid.uuid4().hex,
        "node": "node-a",
        "device": "GPU-0",
        "device_label": "gpu0",
        "workload": "matmul",
        "precision": "bf16",
        "optimization": "eager",
        "size": "default",
        "outcome": "ok",
        "reason": "",
        "started_at": started_at,
        "ended_at": started_at + timedelta(seconds=12),
        "duration_seconds": 12.0,
        "iterations": 100,
        "throughput": 1.0,
        "unit": "FLOP/s",
        "exit_code": 0,
        "stderr_tail": "",
        "classification": "flat",
        "steady_throughput": 1.0,
        "p10_throughput": None,
        "stack_id": STACK_A,
        "device_model": H100,
    }
    row.update(values)
    return row


def store(engine: Engine, rows: Iterable[dict[str, Any]]) -> None:
    with engine.begin() as connection:
        connection.execute(insert(ProbeRunRecord), list(rows))


def fleet(seed: int = 0) -> list[dict[str, Any]]:
    """A small fleet with every complication the query must handle.

    Three nodes (two of H100s, one of A100s with an unknown-model CPU device beside them), two
    stacks, two workloads, two precisions, two problem sizes, groups of one, two and a few hundred
    results, runs archived before device models, stacks and sizes were recorded (NULL), and runs
    that are not results.
    """
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    devices = [
        ("node-a", "GPU-a0", H100),
        ("node-a", "GPU-a1", H100),
        ("node-b", "GPU-b0", H100),
        ("node-c", "GPU-c0", A100),
        ("node-c", "host", UNKNOWN),
        # The same device key on another node (CPUs are all "host"): another device.
        ("node-a", "host", UNKNOWN),
    ]
    for node, device, model in devices:
        for workload, precision, unit, scale in (
            ("matmul", "bf16", "FLOP/s", 7e14),
            ("matmul", "fp32", "FLOP/s", 5e13),
            ("membw", "fp32", "B/s", 2.8e12),
        ):
            for index in range(int(rng.integers(20, 60))):
                rows.append(
                    probe_run(
                        node=node,
                        device=device,
                        device_model=model,
                        workload=workload,
                        precision=precision,
                        unit=unit,
                        stack_id=STACK_A if index % 3 else STACK_B,
                        started_at=NOW - timedelta(days=float(rng.uniform(0, 30))),
                        steady_throughput=float(scale * rng.uniform(0.8, 1.0)),
                    )
                )
    # One large group (odd count), one of two results and one of a single result.
    rows += [
        probe_run(
            node="node-d",
            device="GPU-d0",
            precision="fp16",
            steady_throughput=float(value),
            started_at=NOW - timedelta(days=float(day)),
        )
        for value, day in zip(rng.normal(6e14, 5e13, 501), rng.uniform(0, 30, 501), strict=True)
    ]
    rows += [
        probe_run(node="node-e", device="GPU-e0", precision="fp8", steady_throughput=v)
        for v in (1.2e15, 1.4e15)
    ]
    rows.append(probe_run(node="node-e", device="GPU-e1", precision="int8", steady_throughput=3.0))
    # Small problems on H100s, beside their default-size results: below the sustained rate.
    rows += [
        probe_run(
            node="node-a",
            device=f"GPU-a{index % 2}",
            size="small",
            steady_throughput=float(value),
        )
        for index, value in enumerate(rng.uniform(1e14, 2e14, 7))
    ]
    # Archived before migration 0005: no model, no stack, no size.
    rows += [
        probe_run(
            node="node-f",
            device="GPU-f0",
            device_model=None,
            stack_id=None,
            size=None,
            steady_throughput=v,
        )
        for v in (4e14, 5e14, 6e14)
    ]
    # Runs that never settled: no steady value, their p10 over one-second windows stands in
    # (the p10 basis), beside the steady results of the same groups and in groups of their own.
    for index, value in enumerate(rng.uniform(4e14, 6e14, 9)):
        rows.append(
            probe_run(
                node="node-a" if index % 3 else "node-b",
                device=f"GPU-a{index % 2}" if index % 3 else "GPU-b0",
                device_model=H100,
                stack_id=STACK_A if index % 2 else STACK_B,
                steady_throughput=None,
                classification="no_steady_state",
                p10_throughput=float(value),
                started_at=NOW - timedelta(days=float(rng.uniform(0, 30))),
            )
        )
    rows.append(
        probe_run(
            node="node-c",
            device="host",
            device_model=UNKNOWN,
            workload="membw",
            precision="fp32",
            unit="B/s",
            steady_throughput=None,
            classification="no_steady_state",
            p10_throughput=2.1e10,
        )
    )
    # Not results: a failed run, an ok run too short to judge (with a p10 all the same), an ok
    # run never analysed, one that never settled and has no p10 (under three windows), a
    # timeout, a preempted and an aborted run (whose end was never recorded), a running one.
    rows.append(probe_run(outcome="failed", steady_throughput=None, reason="exit 1"))
    rows.append(
        probe_run(steady_throughput=None, classification="insufficient", p10_throughput=3e14)
    )
    rows.append(probe_run(steady_throughput=None, classification=None))
    rows.append(probe_run(steady_throughput=None, classification="no_steady_state"))
    rows.append(probe_run(outcome="timeout", steady_throughput=None, classification=None))
    rows.append(probe_run(outcome="preempted", steady_throughput=None, classification=None))
    rows.append(
        probe_run(outcome="aborted", ended_at=None, steady_throughput=None, classification=None)
    )
    rows.append(probe_run(outcome="running", ended_at=None, steady_throughput=None))
    # Never ran: not counted at all.
    rows.append(probe_run(outcome="skipped", steady_throughput=None, classification=None))
    rows.append(probe_run(outcome="unsupported", steady_throughput=None, classification=None))
    return rows


def basis_of(row: dict[str, Any]) -> str | None:
    """What a run counts on: ``steady``, ``p10``, or None (left out or not a run)."""
    if row["outcome"] != "ok":
        return None
    if row["steady_throughput"] is not None:
        return "steady"
    if row["classification"] == "no_steady_state" and row["p10_throughput"] is not None:
        return "p10"
    return None


def left_out(
    rows: list[dict[str, Any]], keep: Callable[[dict[str, Any]], bool] = lambda _: True
) -> dict[str, int]:
    """The runs left out, by reason, counted here from the runs themselves."""
    counts = dict.fromkeys(LEFT_OUT_REASONS, 0)
    for row in rows:
        if not keep(row) or basis_of(row) is not None:
            continue
        if row["outcome"] in ("failed", "timeout", "preempted", "aborted"):
            counts[row["outcome"]] += 1
        elif row["outcome"] == "ok":
            counts["insufficient" if row["classification"] == "insufficient" else "no_figure"] += 1
    return counts


def expected(
    rows: list[dict[str, Any]], by: str, keep: Callable[[dict[str, Any]], bool] = lambda _: True
) -> list[CapacityRow]:
    """The capacity rows computed with numpy from the runs themselves."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        basis = basis_of(row)
        if basis is None or not keep(row):
            continue
        key = (
            row[GROUP_COLUMN[by]],
            row["workload"],
            row["precision"],
            row["optimization"],
            row["size"],
            # Written without one, as before migration 0009: the column's default.
            row.get("scope", "device"),
            basis,
            row["unit"],
        )
        groups[key].append(row)
    result = []
    for key, members in groups.items():
        group, workload, precision, optimization, size, scope, basis, unit = key
        values = np.array(
            [m["steady_throughput" if basis == "steady" else "p10_throughput"] for m in members]
        )
        median, p10 = np.quantile(values, [0.5, 0.1])
        models = {m["device_model"] for m in members}
        peak = spec_peak(models.pop(), workload, precision, unit) if len(models) == 1 else None
        if scope == "node_total":
            peak = None
        result.append(
            CapacityRow(
                group=group,
                workload=workload,
                precision=precision,
                optimization=optimization,
                size=size,
                scope=scope,
                basis=basis,
                unit=unit,
                median=float(median),
                p10=float(p10),
                results=len(members),
                devices=len({(m["node"], m["device"]) for m in members}),
                spec_ratio=float(median) / peak if peak else None,
            )
        )
    result.sort(key=order)
    return result


def order(r: CapacityRow) -> tuple[Any, ...]:
    """Sections of one probe, unit and basis (steady, then p10); in each, groups (unknown
    last), then sizes, then scopes: solo, node-wide, node total."""
    return (
        r.workload,
        r.precision,
        r.optimization,
        r.unit is None,
        r.unit or "",
        BASES.index(r.basis),
        r.group is None,
        r.group or "",
        r.size is None,
        r.size or "",
        SCOPES.index(r.scope),
    )


def assert_rows(actual: list[CapacityRow], wanted: list[CapacityRow]) -> None:
    def identity(r: CapacityRow) -> tuple[Any, ...]:
        return (r.group, r.workload, r.precision, r.optimization, r.size, r.scope, r.basis, r.unit)

    assert [identity(r) for r in actual] == [identity(r) for r in wanted]
    for got, want in zip(actual, wanted, strict=True):
        assert (got.results, got.devices) == (want.results, want.devices), want
        assert got.median == pytest.approx(want.median, rel=1e-12), want
        assert got.p10 == pytest.approx(want.p10, rel=1e-12), want
        if want.spec_ratio is None:
            assert got.spec_ratio is None, want
        else:
            assert got.spec_ratio == pytest.approx(want.spec_ratio, rel=1e-12), want


@pytest.fixture
def archive(archive_engine: Engine) -> tuple[Engine, list[dict[str, Any]]]:
    rows = fleet()
    store(archive_engine, rows)
    return archive_engine, rows


@pytest.mark.parametrize("by", ["model", "node", "stack"])
def test_groups_match_numpy(archive: tuple[Engine, list[dict[str, Any]]], by: str) -> None:
    engine, rows = archive
    assert_rows(capacity(engine, by=by), expected(rows, by))


def test_default_groups_by_model(archive: tuple[Engine, list[dict[str, Any]]]) -> None:
    engine, rows = archive
    assert_rows(capacity(engine), expected(rows, "model"))


def test_summaries_streamed_in_many_chunks(
    archive: tuple[Engine, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, rows = archive
    monkeypatch.setattr(capacity_module, "STREAM_CHUNK", 2)
    assert_rows(capacity(engine, by="stack"), expected(rows, "stack"))


@pytest.mark.parametrize(
    ("filters", "keep"),
    [
        ({"precision": "fp32"}, lambda r: r["precision"] == "fp32"),
        ({"workload": "membw"}, lambda r: r["workload"] == "membw"),
        ({"optimization": "eager"}, lambda r: True),
        ({"optimization": "compiled"}, lambda r: False),
        ({"size": "small"}, lambda r: r["size"] == "small"),
        (
            {"workload": "matmul", "precision": "fp32"},
            lambda r: r["workload"] == "matmul" and r["precision"] == "fp32",
        ),
    ],
)
def test_filters(
    archive: tuple[Engine, list[dict[str, Any]]],
    filters: dict[str, Any],
    keep: Callable[[dict[str, Any]], bool],
) -> None:
    engine, rows = archive
    for by in ("model", "node"):
        assert_rows(capacity(engine, by=by, **filters), expected(rows, by, keep))


def test_since_keeps_the_runs_that_ended_at_or_after_it(
    archive: tuple[Engine, list[dict[str, Any]]],
) -> None:
    engine, rows = archive
    since = NOW - timedelta(days=7)
    # One run ends exactly at the cutoff: it is in.
    boundary = probe_run(
        node="node-g",
        device="GPU-g0",
        started_at=since - timedelta(seconds=12),
        steady_throughput=9.0,
    )
    store(engine, [boundary])
    rows = [*rows, boundary]

    def recent(row: dict[str, Any]) -> bool:
        return bool(row["ended_at"] >= since)

    for by in ("model", "stack"):
        assert_rows(capacity(engine, by=by, since=since), expected(rows, by, recent))
    bf16 = capacity(engine, by="node", precision="bf16", since=since)
    assert_rows(bf16, expected(rows, "node", lambda r: recent(r) and r["precision"] == "bf16"))
    assert any(row.group == "node-g" and row.results == 1 for row in bf16)


def test_since_in_another_zone_is_the_same_instant(
    archive: tuple[Engine, list[dict[str, Any]]],
) -> None:
    engine, _ = archive
    since = NOW - timedelta(days=3)
    other = since.astimezone(timezone(timedelta(hours=5, minutes=30)))
    assert capacity(engine, since=other) == capacity(engine, since=since)


def test_spec_ratio_of_a_known_model(archive_engine: Engine) -> None:
    store(
        archive_engine,
        [
            *(
                probe_run(device=f"GPU-{i}", steady_throughput=v)
                for i, v in enumerate((7e14, 8e14))
            ),
            probe_run(workload="membw", precision="fp32", unit="B/s", steady_throughput=3.0e12),
        ],
    )
    matmul, membw = capacity(archive_engine)
    assert (matmul.group, matmul.workload, matmul.devices) == (H100, "matmul", 2)
    assert matmul.median == pytest.approx(7.5e14)
    assert matmul.spec_ratio == pytest.approx(7.5e14 / 989.5e12)
    assert membw.spec_ratio == pytest.approx(3.0e12 / 3.35e12)


def test_no_ratio_for_an_unknown_model_or_workload_or_a_mixed_group(
    archive: tuple[Engine, list[dict[str, Any]]],
) -> None:
    engine, _ = archive
    by_model = capacity(engine, precision="bf16")
    assert {row.group: row.spec_ratio is not None for row in by_model} == {
        H100: True,
        A100: True,
        UNKNOWN: False,
        None: False,
    }
    # node-c has an A100 and a CPU device of another model: its bf16 matmul group mixes them.
    node_c = [row for row in capacity(engine, by="node", precision="bf16") if row.group == "node-c"]
    assert [(row.devices, row.spec_ratio) for row in node_c] == [(2, None)]
    store(engine, [probe_run(workload="attention", steady_throughput=4e14)])
    attention = capacity(engine, workload="attention")
    assert [(row.group, row.spec_ratio) for row in attention] == [(H100, None)]


def test_runs_that_are_not_results_are_left_out(archive_engine: Engine) -> None:
    store(
        archive_engine,
        [
            probe_run(steady_throughput=5.0),
            probe_run(outcome="failed", steady_throughput=None),
            probe_run(outcome="timeout", steady_throughput=None),
            probe_run(steady_throughput=None),
            # A steady value on a run that did not end ok is no result either, nor a p10.
            probe_run(outcome="aborted", steady_throughput=7.0),
            probe_run(outcome="failed", steady_throughput=None, p10_throughput=6.0),
            # A p10 counts only for a run the analysis found never settled.
            probe_run(steady_throughput=None, classification="insufficient", p10_throughput=4.0),
        ],
    )
    answer = capacity_with_runs(archive_engine)
    (row,) = answer.rows
    assert (row.basis, row.results, row.median, row.p10) == ("steady", 1, 5.0, 5.0)
    assert answer.runs == RunsCounted(
        steady=1,
        p10=0,
        left_out={
            "failed": 2,
            "timeout": 1,
            "preempted": 0,
            "aborted": 1,
            "insufficient": 1,
            "no_figure": 1,
        },
    )
    assert capacity(archive_engine) == answer.rows


def test_an_ok_run_without_a_steady_state_counts_on_its_p10(archive_engine: Engine) -> None:
    """Issue 23: four recorded fp32 matmul runs, one of them with a steady state. The one that
    never settled counts on its p10 (marked so, never mixed with the steady figure); the
    timeout and the failure are left out and counted."""
    store(
        archive_engine,
        [
            probe_run(precision="fp32", steady_throughput=5.2e13, p10_throughput=5.0e13),
            probe_run(
                precision="fp32",
                steady_throughput=None,
                classification="no_steady_state",
                p10_throughput=4.6e13,
            ),
            probe_run(precision="fp32", outcome="timeout", steady_throughput=None),
            probe_run(precision="fp32", outcome="failed", steady_throughput=None),
        ],
    )
    answer = capacity_with_runs(archive_engine, workload="matmul", precision="fp32")
    assert [(r.basis, r.results, r.median, r.p10) for r in answer.rows] == [
        ("steady", 1, 5.2e13, 5.2e13),
        ("p10", 1, 4.6e13, 4.6e13),
    ]
    assert (answer.runs.steady, answer.runs.p10, answer.runs.left_out_total) == (1, 1, 2)
    assert answer.runs.left_out["timeout"] == answer.runs.left_out["failed"] == 1
    # Only the run that never settled: the answer no longer is "no result".
    p10_only = capacity_with_runs(archive_engine, precision="fp32", scope="device")
    assert len(p10_only.rows) == 2
    text = render_table(answer.rows, width=80)
    assert text.split("\n\n")[1].splitlines()[0] == (
        "matmul fp32 eager (FLOP/s), p10 basis (no steady state)"
    )
    assert render_runs(answer.runs).splitlines() == [
        "runs used: 2 (1 on a steady basis, 1 on a p10 basis)",
        "runs left out: 2 (1 failed, 1 timeout)",
    ]
    document = capacity_as_json(answer)
    assert json.loads(json.dumps(document)) == document
    assert [row["basis"] for row in document["rows"]] == ["steady", "p10"]
    assert document["runs"] == {
        "used": {"steady": 1, "p10": 1},
        "left_out": {
            "failed": 1,
            "timeout": 1,
            "preempted": 0,
            "aborted": 0,
            "insufficient": 0,
            "no_figure": 0,
        },
    }


@pytest.mark.parametrize("by", ["model", "node", "stack"])
def test_runs_left_out_by_filter_and_period(
    archive: tuple[Engine, list[dict[str, Any]]], by: str
) -> None:
    """The runs left out are those of the same probes and period as the figures: counted here
    from the runs themselves. An aborted run, whose end was never recorded, is in the period of
    its start."""
    engine, rows = archive
    since = NOW - timedelta(days=7)

    def recent(row: dict[str, Any]) -> bool:
        return bool((row["ended_at"] or row["started_at"]) >= since)

    queries: list[tuple[dict[str, Any], Callable[[dict[str, Any]], bool]]] = [
        ({}, lambda _: True),
        ({"precision": "bf16"}, lambda r: r["precision"] == "bf16"),
        ({"workload": "membw"}, lambda r: r["workload"] == "membw"),
        ({"since": since}, recent),
        ({"precision": "bf16", "since": since}, lambda r: r["precision"] == "bf16" and recent(r)),
    ]
    for query, keep in queries:
        answer = capacity_with_runs(engine, by=by, **query)
        assert_rows(answer.rows, expected(rows, by, keep))
        assert answer.runs.left_out == left_out(rows, keep), query
        assert answer.runs.steady == sum(basis_of(r) == "steady" and keep(r) for r in rows)
        assert answer.runs.p10 == sum(basis_of(r) == "p10" and keep(r) for r in rows)
    assert all(left_out(rows).values())  # every reason is there


def test_empty(archive_engine: Engine) -> None:
    assert capacity(archive_engine) == []
    store(archive_engine, [probe_run()])
    assert capacity(archive_engine, precision="fp64") == []
    assert capacity(archive_engine, since=NOW + timedelta(days=1)) == []


def test_rows_are_sorted_by_probe_unit_group_and_size(
    archive: tuple[Engine, list[dict[str, Any]]],
) -> None:
    engine, _ = archive
    rows = capacity(engine)
    keys = [order(r) for r in rows]
    assert keys == sorted(keys)


def test_sizes_are_never_mixed(archive_engine: Engine) -> None:
    """A small problem runs below the sustained rate: it is a row of its own, never the median
    of the default size's."""
    store(
        archive_engine,
        [
            *(
                probe_run(device=f"GPU-{i}", steady_throughput=v)
                for i, v in enumerate((7.0e14, 7.2e14, 7.4e14))
            ),
            probe_run(device="GPU-0", size="small", steady_throughput=2e14),
            probe_run(device="GPU-1", size="small", steady_throughput=3e14),
        ],
    )
    default, small = capacity(archive_engine)
    assert (default.group, default.size, default.results, default.devices) == (
        H100,
        "default",
        3,
        3,
    )
    assert default.median == pytest.approx(7.2e14)
    assert (small.group, small.size, small.results, small.devices) == (H100, "small", 2, 2)
    assert small.median == pytest.approx(2.5e14)
    assert capacity(archive_engine, size="small") == [small]
    assert capacity(archive_engine, size="default") == [default]
    lines = render_table([default, small]).splitlines()
    assert lines[1].split()[:3] == ["MODEL", "SIZE", "SCOPE"]
    assert [line.split()[4:6] for line in lines[2:]] == [["default", "solo"], ["small", "solo"]]


def test_the_writer_records_the_size_the_child_ran(archive_engine: Engine) -> None:
    writer = ProbeRunWriter(archive_engine, "node-a")
    small = ProbeSpec("matmul", "fp32", "eager", 1.0, CPU, size="small")
    default = ProbeSpec("matmul", "fp32", "eager", 1.0, CPU)  # no size: the workload's default
    at = NOW.timestamp()
    writer.start("a" * 32, small, at)
    writer.finish(ProbeRun("b" * 32, default, "ok", "", at, at + 1, manifest={"size": "default"}))
    # What the child reports wins over what was asked: a problem divided to fit the duration.
    manifest = {"size": "default/4"}
    writer.finish(ProbeRun("c" * 32, default, "ok", "", at, at + 1, manifest=manifest))
    writer.finish(ProbeRun("d" * 32, small, "failed", "exit 1", at, at + 1))  # no manifest
    with archive_engine.connect() as connection:
        sizes = connection.execute(
            select(ProbeRunRecord.run_id, ProbeRunRecord.size).order_by(ProbeRunRecord.run_id)
        ).all()
    assert [tuple(row) for row in sizes] == [
        ("a" * 32, "small"),
        ("b" * 32, "default"),
        ("c" * 32, "default/4"),
        ("d" * 32, "small"),
    ]


# Node-wide runs


def node_wide(runs: list[tuple[float, float]], node: str = "node-a") -> list[dict[str, Any]]:
    """Node-wide bf16 matmul runs of ``node``'s two H100s, as the scheduler archives them: each
    device's run (scope "node") and the node's sum (device "node", scope "node_total"), linked
    by one group id. ``runs`` gives each run's two steady figures."""
    rows = []
    for index, figures in enumerate(runs):
        group = uuid.uuid4().hex
        started_at = NOW - timedelta(hours=index + 2)
        rows += [
            probe_run(
                node=node,
                device=f"GPU-{device}",
                device_label=f"gpu{device}",
                scope="node",
                group_id=group,
                coupling_ratio=figure / 7.2e14,
                started_at=started_at,
                steady_throughput=figure,
            )
            for device, figure in enumerate(figures)
        ]
        rows.append(
            probe_run(
                node=node,
                device="node",
                device_label="node",
                scope="node_total",
                group_id=group,
                coupling_ratio=sum(figures) / 1.44e15,
                started_at=started_at,
                steady_throughput=sum(figures),
            )
        )
    return rows


NODE_WIDE_RUNS = [(5.6e14, 5.8e14), (5.4e14, 5.7e14), (5.9e14, 6.0e14)]


def test_solo_and_node_wide_results_are_rows_of_their_own(archive_engine: Engine) -> None:
    """What a device sustains alone and what it sustains while its whole node works are never
    one median: each scope is a row, solo first, then node-wide, then the node's sum."""
    solo = [7.0e14, 7.2e14, 7.4e14]
    store(
        archive_engine,
        [
            *(
                # The scope of every row of one insert: its first row's columns are the insert's.
                probe_run(node=node, device=device, scope="device", steady_throughput=value)
                for (node, device), value in zip(
                    [("node-a", "GPU-0"), ("node-a", "GPU-1"), ("node-b", "GPU-0")],
                    solo,
                    strict=True,
                )
            ),
            *node_wide(NODE_WIDE_RUNS),
        ],
    )
    rows = capacity(archive_engine)
    assert [(r.group, r.size, r.scope, r.results, r.devices) for r in rows] == [
        (H100, "default", "device", 3, 3),
        (H100, "default", "node", 6, 2),
        (H100, "default", "node_total", 3, 1),  # one node
    ]
    per_device = [figure for run in NODE_WIDE_RUNS for figure in run]
    totals = [sum(run) for run in NODE_WIDE_RUNS]
    for row, values in zip(rows, [solo, per_device, totals], strict=True):
        median, p10 = np.quantile(values, [0.5, 0.1])
        assert row.median == pytest.approx(median, rel=1e-12), row.scope
        assert row.p10 == pytest.approx(p10, rel=1e-12), row.scope
    assert rows[0].median == pytest.approx(7.2e14)
    assert rows[1].median == pytest.approx(5.75e14)
    assert rows[2].median == pytest.approx(1.14e15)
    # The node's sum is no device's: no spec ratio.
    assert [r.spec_ratio is not None for r in rows] == [True, True, False]
    for row in rows:
        assert capacity(archive_engine, scope=row.scope) == [row]
    lines = render_table(rows).splitlines()
    assert lines[1].split()[:3] == ["MODEL", "SIZE", "SCOPE"]
    assert [line.split()[:2] for line in lines[2:] if not line.startswith("NVIDIA")] == [
        ["default", "solo"],
        ["default", "node-wide"],
        ["default", "node-total"],
    ]
    assert [o["scope"] for o in rows_as_json(rows)] == ["device", "node", "node_total"]


@pytest.mark.parametrize("by", ["model", "node", "stack"])
def test_node_wide_groups_match_numpy(
    archive: tuple[Engine, list[dict[str, Any]]], by: str
) -> None:
    engine, rows = archive
    extra = [*node_wide(NODE_WIDE_RUNS), *node_wide([(6.1e14, 6.2e14)], node="node-b")]
    store(engine, extra)
    rows = [*rows, *extra]
    assert_rows(capacity(engine, by=by), expected(rows, by))
    for scope in SCOPES:
        wanted = expected([row for row in rows if row.get("scope", "device") == scope], by)
        assert_rows(capacity(engine, by=by, scope=scope), wanted)


def test_runs_archived_before_node_wide_runs_are_solo(database_url: str) -> None:
    engine = open_engine(database_url)
    try:
        upgrade(engine, "0008")
        store(engine, [probe_run(steady_throughput=7.0e14)])
        upgrade(engine)
        (row,) = capacity(engine)
    finally:
        engine.dispose()
    assert (row.scope, row.results, row.median) == ("device", 1, 7.0e14)


def test_the_writer_records_the_scope_group_and_coupling(archive_engine: Engine) -> None:
    writer = ProbeRunWriter(archive_engine, "node-a")
    solo = ProbeSpec("matmul", "fp32", "eager", 1.0, CPU)
    member = ProbeSpec("matmul", "fp32", "eager", 1.0, CPU, scope="node")
    at = NOW.timestamp()
    writer.finish(ProbeRun("a" * 32, solo, "ok", "", at, at + 1))
    writer.finish(ProbeRun("b" * 32, member, "ok", "", at, at + 1, group="g" * 32), coupling=0.8)
    with archive_engine.connect() as connection:
        found = connection.execute(
            select(
                ProbeRunRecord.run_id,
                ProbeRunRecord.scope,
                ProbeRunRecord.group_id,
                ProbeRunRecord.coupling_ratio,
            ).order_by(ProbeRunRecord.run_id)
        ).all()
    assert [tuple(row) for row in found] == [
        ("a" * 32, "device", None, None),
        ("b" * 32, "node", "g" * 32, 0.8),
    ]


def test_bad_arguments(archive_engine: Engine) -> None:
    with pytest.raises(ValueError, match="cannot group by 'gpu'"):
        capacity(archive_engine, by="gpu")
    with pytest.raises(ValueError, match="naive datetime"):
        capacity(archive_engine, since=datetime(2026, 11, 1))
    with pytest.raises(ValueError, match="no scope 'solo'"):
        capacity(archive_engine, scope="solo")


def test_database_errors_are_archive_errors(database_url: str) -> None:
    engine = open_engine(database_url)  # never migrated: there is no probe_results view
    try:
        with pytest.raises(ArchiveError, match=r"^cannot query .*probe_results") as caught:
            capacity(engine)
        assert "\n" not in str(caught.value)
    finally:
        engine.dispose()


CAPACITY_INDEXES = {
    *(
        f"ix_probe_runs_{basis}by_{index}"
        for basis in ("results_", "p10_results_")
        for index in ("device", "model", "stack")
    ),
    "ix_probe_runs_left_out",
}


def explained_plans(engine: Engine, run: Callable[[], object]) -> Iterator[str]:
    """SQLite's query plan of every statement ``run`` executes."""
    statements: list[tuple[str, Any]] = []

    def record(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            statements.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", record)
    try:
        run()
    finally:
        event.remove(engine, "before_cursor_execute", record)
    with engine.connect() as connection:
        for statement, parameters in statements:
            plan = connection.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters)
            yield " / ".join(str(row[-1]) for row in plan)


@pytest.mark.parametrize(
    "filters",
    [
        {},
        {"precision": "bf16"},
        {"workload": "matmul"},
        {"optimization": "eager"},
        {"workload": "matmul", "precision": "bf16", "optimization": "eager"},
        {"size": "small"},
        {"scope": "node"},
        {"since": NOW - timedelta(days=7)},
        {"precision": "bf16", "since": NOW - timedelta(days=7)},
    ],
)
@pytest.mark.parametrize("by", ["model", "stack"])
def test_sqlite_reads_the_capacity_indexes_without_sorting(
    tmp_path: Path, filters: dict[str, Any], by: str
) -> None:
    """A million results stay near a second only if SQLite follows the capacity indexes: its
    planner has no statistics, and given the chance it sorts the whole view instead. The p10
    basis reads its own partial indexes, the runs left out theirs; never the table."""
    engine = open_engine(f"sqlite:///{tmp_path / 'archive.db'}")
    try:
        upgrade(engine)
        store(engine, fleet())
        store(engine, node_wide(NODE_WIDE_RUNS))
        plans = list(explained_plans(engine, lambda: capacity_with_runs(engine, by=by, **filters)))
    finally:
        engine.dispose()
    assert plans
    read = set()
    for plan in plans:
        index = re.search(r"USING (?:COVERING )?INDEX (\w+)", plan)
        assert index is not None, plan
        assert index[1] in CAPACITY_INDEXES, plan
        assert "TEMP B-TREE" not in plan, plan
        read.add(index[1])
    # Both bases' device summaries and the runs left out are read whatever the filters.
    assert {
        "ix_probe_runs_results_by_device",
        "ix_probe_runs_p10_results_by_device",
        "ix_probe_runs_left_out",
    } <= read


# --since


@pytest.mark.parametrize(
    ("text", "instant"),
    [
        ("7d", NOW - timedelta(days=7)),
        ("24h", NOW - timedelta(hours=24)),
        ("30m", NOW - timedelta(minutes=30)),
        ("45s", NOW - timedelta(seconds=45)),
        ("2w", NOW - timedelta(weeks=2)),
        (" 7D ", NOW - timedelta(days=7)),
        ("2026-11-01", datetime(2026, 11, 1, tzinfo=UTC)),
        ("2026-11-01T08:30:00", datetime(2026, 11, 1, 8, 30, tzinfo=UTC)),
        ("2026-11-01 08:30", datetime(2026, 11, 1, 8, 30, tzinfo=UTC)),
        ("2026-11-01T08:30:00Z", datetime(2026, 11, 1, 8, 30, tzinfo=UTC)),
        ("2026-11-01T10:30:00+02:00", datetime(2026, 11, 1, 8, 30, tzinfo=UTC)),
    ],
)
def test_parse_since(text: str, instant: datetime) -> None:
    parsed = parse_since(text, NOW)
    assert parsed == instant
    assert parsed.utcoffset() == timedelta(0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "neither a duration"),
        ("7", "neither a duration"),
        ("d", "neither a duration"),
        ("-7d", "neither a duration"),
        ("7x", "neither a duration"),
        ("1.5d", "neither a duration"),
        ("yesterday", "neither a duration"),
        ("2026-13-01", "neither a duration"),
        ("0d", "more than zero"),
        ("99999999999d", "too long"),
        ("2026-12-01", "in the future"),
    ],
)
def test_parse_since_refuses(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        parse_since(text, NOW)
    assert str(caught.value).startswith(f"--since {text!r}")
    assert "\n" not in str(caught.value)


# Output


@pytest.mark.parametrize(
    ("value", "unit", "text"),
    [
        (8.123e14, "FLOP/s", "812.3 TFLOP/s"),
        (9.895e14, "FLOP/s", "989.5 TFLOP/s"),
        (1.979e15, "FLOP/s", "1.979 PFLOP/s"),
        (3.35e12, "B/s", "3.350 TB/s"),
        (45.67e9, "B/s", "45.67 GB/s"),
        (1500.0, "tokens/s", "1.500 ktokens/s"),
        (999.96, "tokens/s", "1.000 ktokens/s"),
        (12.5, "tokens/s", "12.50 tokens/s"),
        (0.0125, "s", "12.50 ms"),
        (0.0, "FLOP/s", "0 FLOP/s"),
        (5.0, None, "5.000"),
    ],
)
def test_human(value: float, unit: str | None, text: str) -> None:
    assert human(value, unit) == text


def test_render_table_aligns_columns(archive: tuple[Engine, list[dict[str, Any]]]) -> None:
    engine, _ = archive
    rows = capacity(engine, by="stack", precision="bf16")
    sections = render_table(rows, by="stack").split("\n\n")
    headings = [section.splitlines()[0] for section in sections]
    assert headings == [
        "matmul bf16 eager (FLOP/s)",
        "matmul bf16 eager (FLOP/s), p10 basis (no steady state)",
    ]
    steady = [row for row in rows if row.basis == "steady"]
    assert rows[: len(steady)] == steady  # the steady section first
    lines = sections[0].splitlines()[1:]
    assert lines[0].split() == ["STACK", *COLUMNS]
    assert len(lines) == len(steady) + 1
    assert [line.split()[0] for line in sections[1].splitlines()[2:]] == [
        STACK_A[:12],
        STACK_B[:12],
    ]
    # Stack ids are shortened, the missing one shown as "-"; numbers end in one column.
    assert {line.split()[0] for line in lines[1:]} == {STACK_A[:12], STACK_B[:12], "-"}
    assert len({len(line) for line in lines}) == 1
    # The unit is in the heading; the figures carry its prefix, digits aligned.
    assert " T " in lines[1]
    assert "FLOP/s" not in "".join(lines)
    assert max(len(line) for line in lines) <= 80
    assert render_table([]) == "no probe results match"


def test_render_table_has_a_section_per_probe_and_unit(
    archive: tuple[Engine, list[dict[str, Any]]],
) -> None:
    engine, _ = archive
    rows = capacity(engine)
    sections = render_table(rows, width=100).split("\n\n")  # a line per row
    assert [section.splitlines()[0] for section in sections] == [
        "matmul bf16 eager (FLOP/s)",
        "matmul bf16 eager (FLOP/s), p10 basis (no steady state)",
        "matmul fp16 eager (FLOP/s)",
        "matmul fp32 eager (FLOP/s)",
        "matmul fp8 eager (FLOP/s)",
        "matmul int8 eager (FLOP/s)",
        "membw fp32 eager (B/s)",
        "membw fp32 eager (B/s), p10 basis (no steady state)",
    ]
    assert sum(len(section.splitlines()) - 2 for section in sections) == len(rows)


def cpu_row(name: str, size: str = "default") -> CapacityRow:
    return CapacityRow(
        group=name,
        workload="matmul",
        precision="fp32",
        optimization="eager",
        size=size,
        scope="device",
        basis="steady",
        unit="FLOP/s",
        median=2.5e12,
        p10=2.25e12,
        results=40,
        devices=1,
        spec_ratio=None,
    )


def test_render_table_puts_a_name_too_long_for_its_column_on_a_line_of_its_own() -> None:
    long_name = "Intel(R) Xeon(R) Platinum 8480+ Sapphire Rapids"
    rows = [cpu_row(long_name), cpu_row("AMD EPYC 7763", "small")]
    lines = render_table(rows, width=80).splitlines()
    assert lines[1].split() == ["MODEL", *COLUMNS]
    assert lines[2] == long_name
    assert lines[3].split() == ["default", "solo", "2.500", "T", "2.250", "T", "-", "40", "1"]
    assert lines[4].split()[:5] == ["AMD", "EPYC", "7763", "small", "solo"]
    assert max(len(line) for line in lines) <= 80
    # The SIZE column starts where it does on the other lines.
    assert lines[3].index("default") == lines[4].index("small") == lines[1].index("SIZE")
    # A wide terminal keeps each row on one line.
    assert render_table(rows, width=120).splitlines()[2].startswith(long_name + "  default")


def test_render_table_becomes_blocks_where_not_even_the_figures_fit() -> None:
    name = "Intel(R) Xeon(R) Platinum 8480+"
    assert render_table([cpu_row(name)], width=50).splitlines() == [
        "matmul fp32 eager (FLOP/s)",
        f"  MODEL    {name}",
        "  SIZE     default",
        "  SCOPE    solo",
        "  MEDIAN   2.500 TFLOP/s",
        "  P10      2.250 TFLOP/s",
        "  SPEC     -",
        "  RESULTS  40",
        "  DEVICES  1",
    ]


def test_rows_as_json(archive: tuple[Engine, list[dict[str, Any]]]) -> None:
    engine, _ = archive
    rows = capacity(engine, precision="bf16")
    objects = rows_as_json(rows)
    assert json.loads(json.dumps(objects)) == objects
    assert objects[0] == {
        "group": rows[0].group,
        "workload": rows[0].workload,
        "precision": rows[0].precision,
        "optimization": rows[0].optimization,
        "size": rows[0].size,
        "scope": "device",
        "basis": "steady",
        "unit": rows[0].unit,
        "median": rows[0].median,
        "p10": rows[0].p10,
        "results": rows[0].results,
        "devices": rows[0].devices,
        "spec_ratio": rows[0].spec_ratio,
    }


# Spec peaks


@pytest.mark.parametrize(
    ("model", "workload", "precision", "peak"),
    [
        (H100, "matmul", "bf16", 989.5e12),
        (H100, "matmul", "fp32", 67e12),
        (H100, "matmul", "fp8", 1979e12),
        (H100, "membw", "fp32", 3.35e12),
        ("NVIDIA H100 PCIe", "matmul", "bf16", 756.5e12),
        ("NVIDIA H100 PCIe", "membw", "fp32", 2.0e12),
        ("NVIDIA H200", "matmul", "bf16", 989.5e12),
        ("NVIDIA H200", "membw", "fp32", 4.8e12),
        (A100, "matmul", "tf32", 156e12),
        (A100, "membw", "fp32", 2039e9),
        ("NVIDIA A100-SXM4-40GB", "membw", "fp32", 1555e9),
        ("NVIDIA A100-PCIE-40GB", "matmul", "int8", 624e12),
        ("NVIDIA A100 80GB PCIe", "membw", "fp32", 1935e9),
        ("NVIDIA L40S", "matmul", "fp16", 362.05e12),
        ("NVIDIA L40S", "membw", "fp32", 864e9),
    ],
)
def test_spec_peaks(model: str, workload: str, precision: str, peak: float) -> None:
    assert spec_peak(model, workload, precision) == pytest.approx(peak)


@pytest.mark.parametrize(
    ("model", "workload", "precision", "unit"),
    [
        (None, "matmul", "bf16", "FLOP/s"),
        (UNKNOWN, "matmul", "bf16", "FLOP/s"),
        ("Intel(R) Xeon(R) Platinum 8480+", "matmul", "fp32", "FLOP/s"),
        # Variants whose figures differ from their family's are not lent the family's.
        ("NVIDIA H100 NVL", "matmul", "bf16", "FLOP/s"),
        ("NVIDIA H200 NVL", "matmul", "bf16", "FLOP/s"),
        ("NVIDIA H100 SXM5 64GB", "matmul", "bf16", "FLOP/s"),
        ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "matmul", "bf16", "FLOP/s"),
        ("NVIDIA A100X", "membw", "fp32", "B/s"),
        # No FP8 on Ampere; no spec figure for these workloads; a unit no spec is in.
        (A100, "matmul", "fp8", "FLOP/s"),
        (H100, "attention", "bf16", "FLOP/s"),
        (H100, "inference", "bf16", "tokens/s"),
        (H100, "h2d", "fp32", "B/s"),
        (H100, "matmul", "bf16", "B/s"),
    ],
)
def test_no_spec_peak(model: str | None, workload: str, precision: str, unit: str) -> None:
    assert spec_peak(model, workload, precision, unit) is None
