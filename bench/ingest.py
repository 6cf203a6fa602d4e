"""Archive ingest rate through the agent's ArchiveSink (spool, then drain), SQLite and PostgreSQL.

Everything the agent archives is appended to its local spool (a SQLite file in WAL mode with
synchronous=FULL, one JSON payload per write) and applied to the database, in order, by the
drain. This bench drives agent.archive.sink.ArchiveSink as the daemon does, in two phases for
each kind of write, so each side has its own figure:

- rollups: --batches rollup periods of one node with --gpus GPUs, each one ``add_rollups`` call
  as the archive job makes it: one row per series (the NVML collector's 35 fields per GPU and 40
  host series; 320 rows with 8 GPUs), then ``drain()`` (one transaction per batch);
- probe runs: --runs runs, each a ``start`` and a ``finish`` (manifest, result, analysis JSON
  with its attribution, and a 600-iteration series, as a 10 s matmul probe leaves), then
  ``drain()`` (a transaction for the start, another for the finish and its series).

Reported: rows (runs) per second appended to the spool, applied to the database, and end to end
(rows over append plus drain time). SQLite: a fresh file in a temporary directory; PostgreSQL: a
fresh database on the development server (127.0.0.1:5432, user postgres), dropped at the end.

    .venv/bin/python bench/ingest.py [--batches 100] [--runs 200] [--backend sqlite postgresql]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy
from sqlalchemy import Engine, create_engine, text

from agent.archive.database import open_engine, upgrade
from agent.archive.sink import ArchiveSink
from agent.archive.spool import Spool
from agent.probes.analysis import RunAnalysis
from agent.probes.attribution import Attribution, SegmentTelemetry
from agent.probes.protocol import Iteration
from agent.probes.runner import ProbeDevice, ProbeRun, ProbeSpec
from agent.telemetry.rollup import RollupRow
from collectors.nvml.collector import NvmlCollector

POSTGRES_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432"
POSTGRES_MAINTENANCE_URL = f"{POSTGRES_SERVER}/test"
HOST_SERIES = 40
PERIOD_SECONDS = 60
ITERATIONS = 600


def rollup_batch(period_start: float, gpus: int, fields: list[str]) -> list[RollupRow]:
    rows = [
        RollupRow("nvml", f"GPU-{gpu:08d}-0000-0000-0000-000000000000", name, "", "gauge",
                  period_start, PERIOD_SECONDS, 610.0, 600.0, 620.0, 618.0, PERIOD_SECONDS)
        for gpu in range(gpus)
        for name in fields
    ]  # fmt: skip
    rows += [
        RollupRow("host", "host", "cpu_frequency_hertz", f"cpu={cpu}", "gauge", period_start,
                  PERIOD_SECONDS, 2.0e9, 1.9e9, 2.1e9, 2.09e9, PERIOD_SECONDS)
        for cpu in range(HOST_SERIES)
    ]  # fmt: skip
    return rows


def probe_run(index: int, started_at: float) -> tuple[ProbeRun, RunAnalysis]:
    device = ProbeDevice(
        "cuda", f"GPU-{index % 8:08d}-0000-0000-0000-000000000000", f"gpu{index % 8}"
    )
    spec = ProbeSpec("matmul", "bf16", "eager", 10.0, device, "default")
    step = 10.0 / ITERATIONS
    iterations = tuple(
        Iteration(i, started_at + i * step, started_at + (i + 1) * step, 1.1e12, "measure")
        for i in range(ITERATIONS)
    )
    manifest = {
        "event": "manifest",
        "workload": "matmul",
        "version": 1,
        "precision": "bf16",
        "optimization": "eager",
        "unit": "FLOP/s",
        "work_unit": "flop",
        "device": {"kind": "cuda", "label": device.label, "device_name": "NVIDIA H100 80GB HBM3"},
        "device_name": "NVIDIA H100 80GB HBM3",
        "parameters": {"m": 8192, "n": 8192, "k": 8192, "repeats": 4},
        "torch": "2.5.1+cu124",
        "cuda": "12.4",
        "duration": 10.0,
    }
    ended_at = started_at + 10.0
    run = ProbeRun(
        uuid.uuid4().hex, spec, "ok", "", started_at, ended_at, manifest,
        {"event": "result", "throughput": 6.6e14}, iterations, 0, "",
    )  # fmt: skip
    figures = {
        "classification": "flat",
        "n": ITERATIONS,
        "steady_start_index": 12,
        "steady_throughput": 6.6e14,
        "steady_ci": [6.59e14, 6.61e14],
        "peak_throughput": 6.8e14,
        "sustained_ratio": 0.97,
        "changepoints": [12],
        "warmup_seconds": 0.2,
        "reason": "one steady regime after 0.2 s of warm-up, within 2.0%",
    }
    segments = (
        SegmentTelemetry(started_at, started_at + 0.2, 2, {}, 1.98e9, 650.0, 60.0, 0.0),
        SegmentTelemetry(started_at + 0.2, ended_at, 98, {"sw_power_cap": 0.8}, 1.755e9, 700.0,
                         71.0, 0.0),
    )  # fmt: skip
    attribution = Attribution(segments, None, 6.6e14 / 700.0, "flat: no slowdown to explain")
    return run, RunAnalysis(figures, attribution)


def timed(work: Any) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def drain(sink: ArchiveSink) -> None:
    if not sink.drain() or sink.status().rejected:
        raise SystemExit(f"the drain failed: {sink.status()}")


def bench_backend(backend: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    admin: Engine | None = None
    name = f"sustain_bench_{uuid.uuid4().hex[:12]}"
    if backend == "sqlite":
        url = f"sqlite:///{work / f'{backend}.db'}"
    else:
        admin = create_engine(POSTGRES_MAINTENANCE_URL, isolation_level="AUTOCOMMIT")
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
        url = f"{POSTGRES_SERVER}/{name}"
    engine = open_engine(url)
    spool = Spool(work / f"{backend}-spool.db")
    try:
        upgrade(engine)
        sink = ArchiveSink(engine, "bench-node", spool)
        fields = list(NvmlCollector().fields)
        now = time.time() - args.batches * PERIOD_SECONDS
        batches = [
            rollup_batch(now + b * PERIOD_SECONDS, args.gpus, fields) for b in range(args.batches)
        ]
        rows = sum(len(batch) for batch in batches)

        def append_rollups() -> None:
            for batch in batches:
                sink.add_rollups(batch)

        append = timed(append_rollups)
        applied = timed(lambda: drain(sink))
        rollups = {
            "batches": args.batches,
            "rows": rows,
            "rows_per_batch": rows // args.batches,
            "append_rows_per_s": rows / append,
            "drain_rows_per_s": rows / applied,
            "end_to_end_rows_per_s": rows / (append + applied),
        }

        runs = [probe_run(index, now + index * 15.0) for index in range(args.runs)]

        def append_runs() -> None:
            for run, analysis in runs:
                sink.start(run.id, run.spec, run.started_at)
                sink.finish(run, analysis=analysis, stack_id="ab" * 32)

        append = timed(append_runs)
        applied = timed(lambda: drain(sink))
        probe_runs = {
            "runs": args.runs,
            "iterations_per_run": ITERATIONS,
            "append_runs_per_s": args.runs / append,
            "drain_runs_per_s": args.runs / applied,
            "end_to_end_runs_per_s": args.runs / (append + applied),
        }
        with engine.connect() as connection:
            stored = connection.execute(text("SELECT COUNT(*) FROM telemetry_rollups")).scalar()
            stored_runs = connection.execute(text("SELECT COUNT(*) FROM probe_runs")).scalar()
        if (stored, stored_runs) != (rows, args.runs):
            raise SystemExit(f"{backend}: stored {stored} rollups, {stored_runs} runs")
        return {"rollups": rollups, "probe_runs": probe_runs}
    finally:
        spool.close()
        engine.dispose()
        if admin is not None:
            with admin.connect() as connection:
                connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            admin.dispose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=100, help="rollup periods")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs of the node the rollups are of")
    parser.add_argument("--runs", type=int, default=200, help="probe runs")
    parser.add_argument(
        "--backend", nargs="+", choices=["sqlite", "postgresql"], default=["sqlite", "postgresql"]
    )
    args = parser.parse_args()
    figures: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as work:
        for backend in args.backend:
            figures[backend] = bench_backend(backend, args, Path(work))
    first = figures[args.backend[0]]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus, Python "
        f"{platform.python_version()}, SQLAlchemy {sqlalchemy.__version__}; "
        f"{args.batches} rollup batches of {first['rollups']['rows_per_batch']} rows, "
        f"{args.runs} probe runs of {ITERATIONS} iterations"
    )
    print("| backend | write | into the spool | spool to database | end to end |")
    print("|---|---|---|---|---|")
    for backend, result in figures.items():
        r, p = result["rollups"], result["probe_runs"]
        print(
            f"| {backend} | rollup rows | {r['append_rows_per_s']:,.0f}/s "
            f"| {r['drain_rows_per_s']:,.0f}/s | {r['end_to_end_rows_per_s']:,.0f}/s |"
        )
        print(
            f"| {backend} | probe runs | {p['append_runs_per_s']:,.1f}/s "
            f"| {p['drain_runs_per_s']:,.1f}/s | {p['end_to_end_runs_per_s']:,.1f}/s |"
        )
    print("RESULT " + json.dumps({"backends": figures}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
