"""Time of ``sustain capacity`` over a million probe results, SQLite and PostgreSQL (target: 1 s).

    .venv/bin/python bench/capacity.py [--results 1000000] [--backend sqlite postgresql]

The archive of a fleet after a quarter: 200 nodes of 8 GPUs (100 nodes of H100 SXM, 60 of A100
SXM4 80GB, 40 of L40S), each GPU probed with matmul in six precisions (fp32, tf32, bf16, fp16,
fp8, int8; no fp8 on the A100s) and membw, at random times over 90 days; four software stacks
rolled out node by node at random times; 2% of the GPUs 15% slow. Each run carries its manifest
and analysis JSON as the agent writes them (about 1.2 KB a row), since a query that reads the
table rather than an index pays for them; 3% more runs failed (not results).

The SQLite archive is a fresh file in a temporary directory; the PostgreSQL one a fresh database
on the development server (127.0.0.1:5432, user postgres, as the tests use it), dropped at the
end. Both are migrated with ``agent.archive.database.upgrade`` and loaded in one transaction
(executemany in chunks on SQLite, COPY on PostgreSQL); PostgreSQL is then vacuumed and analysed,
as its autovacuum would have done in a live archive. Prints a markdown table of the best of three
wall times of each query, and as its last line `RESULT {json}` for bench/run_all.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import sqlalchemy
from sqlalchemy import Engine, create_engine, text

from agent.archive.database import open_engine, upgrade
from agent.archive.models import ProbeRunRecord
from agent.reports.capacity import capacity, parse_since
from agent.reports.specs import spec_peak

POSTGRES_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432"
POSTGRES_MAINTENANCE_URL = f"{POSTGRES_SERVER}/test"

NODES = 200
GPUS_PER_NODE = 8
DAYS = 90
MODELS = (("NVIDIA H100 80GB HBM3", 100), ("NVIDIA A100-SXM4-80GB", 60), ("NVIDIA L40S", 40))
PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8")
PROBES = (*(("matmul", precision, "FLOP/s") for precision in PRECISIONS), ("membw", "fp32", "B/s"))
EFFICIENCY = {"fp32": 0.8, "tf32": 0.6, "bf16": 0.7, "fp16": 0.7, "fp8": 0.6, "int8": 0.65}
STACK_FACTORS = (1.0, 1.02, 0.97, 1.03)
STACKS = tuple(hashlib.sha256(f"stack {i}".encode()).hexdigest() for i in range(4))
FAILED_SHARE = 0.03
CHUNK = 10_000
TARGET_S = 1.0
REPEATS = 3

COLUMNS = (
    "run_id",
    "node",
    "device",
    "device_label",
    "workload",
    "precision",
    "optimization",
    "size",
    "outcome",
    "reason",
    "started_at",
    "ended_at",
    "duration_seconds",
    "iterations",
    "throughput",
    "unit",
    "exit_code",
    "manifest",
    "result",
    "stderr_tail",
    "classification",
    "peak_throughput",
    "steady_throughput",
    "steady_ci_low",
    "steady_ci_high",
    "sustained_ratio",
    "steady_start_index",
    "warmup_seconds",
    "cause",
    "work_per_joule",
    "analysis",
    "stack_id",
    "device_model",
    "steady_sm_clock_hertz",
    "steady_temperature_celsius",
    "steady_power_watts",
    "steady_thermal_share",
    "steady_power_share",
)


def manifest(workload: str, precision: str, unit: str, model: str, label: str) -> str:
    return json.dumps(
        {
            "event": "manifest",
            "workload": workload,
            "version": 1,
            "precision": precision,
            "optimization": "eager",
            "size": "default",
            "unit": unit,
            "work_unit": "flop" if unit == "FLOP/s" else "byte",
            "device": {"kind": "cuda", "label": label, "device_name": model, "memory": 85e9},
            "device_name": model,
            "parameters": {"m": 8192, "n": 8192, "k": 8192, "repeats": 4},
            "shapes": {"a": [8192, 8192], "b": [8192, 8192], "c": [8192, 8192]},
            "torch": "2.5.1+cu124",
            "cuda": "12.4",
            "duration": 10.0,
        },
        sort_keys=True,
    )


def analysis(steady: float, peak: float) -> str:
    return json.dumps(
        {
            "classification": "flat",
            "n": 600,
            "steady_start_index": 12,
            "steady_throughput": steady,
            "steady_ci": [steady * 0.999, steady * 1.001],
            "peak_throughput": peak,
            "sustained_ratio": steady / peak,
            "changepoints": [12],
            "warmup_seconds": 0.4,
            "mser5_index": 10,
            "outliers": 3,
            "tolerance": 0.02,
            "latency_p50_seconds": None,
            "latency_p90_seconds": None,
            "latency_p99_seconds": None,
            "reason": "one steady regime after 0.4 s of warm-up, within 2.0%",
            "phase": "measure",
            "attribution": {
                "cause": "not clock-bound",
                "segments": [
                    {"sm_clock_hertz": 1.98e9, "power_watts": 690.0, "reasons": {"0x4": 0.1}},
                    {"sm_clock_hertz": 1.755e9, "power_watts": 700.0, "reasons": {"0x4": 0.8}},
                ],
                "work_per_joule": steady / 700.0,
            },
        },
        sort_keys=True,
    )


def runs(total: int, now: datetime, seed: int = 0) -> Iterator[list[dict[str, Any]]]:
    """The runs, node by node, as column dicts with aware datetimes."""
    rng = np.random.default_rng(seed)
    devices = NODES * GPUS_PER_NODE
    start = now - timedelta(days=DAYS)
    models = [model for model, count in MODELS for _ in range(count)]
    for node_index, model in enumerate(models):
        node = f"gpu-node-{node_index:03d}"
        upgrades = np.sort(rng.uniform(0, DAYS * 86_400, len(STACKS) - 1))
        probes = [p for p in PROBES if spec_peak(model, p[0], p[1], p[2]) is not None]
        chunk: list[dict[str, Any]] = []
        for gpu in range(GPUS_PER_NODE):
            device = (
                f"GPU-{uuid.UUID(int=int(rng.integers(1 << 62)) << 64 | node_index << 8 | gpu)}"
            )
            slow = 0.85 if rng.random() < 0.02 else 1.0
            results = total // devices + (
                1 if node_index * GPUS_PER_NODE + gpu < total % devices else 0
            )
            failed = int(results * FAILED_SHARE)
            offsets = rng.uniform(0, DAYS * 86_400, results + failed)
            which = rng.integers(0, len(probes), results + failed)
            noise = 1 + 0.01 * rng.standard_normal(results + failed)
            for index in range(results + failed):
                workload, precision, unit = probes[which[index]]
                stack = int(np.searchsorted(upgrades, offsets[index]))
                peak = spec_peak(model, workload, precision, unit) or 0.0
                efficiency = 0.85 if workload == "membw" else EFFICIENCY[precision]
                steady = peak * efficiency * STACK_FACTORS[stack] * slow * float(noise[index])
                started_at = start + timedelta(seconds=float(offsets[index]))
                ok = index < results
                chunk.append(
                    {
                        "run_id": uuid.uuid4().hex,
                        "node": node,
                        "device": device,
                        "device_label": f"gpu{gpu}",
                        "workload": workload,
                        "precision": precision,
                        "optimization": "eager",
                        "size": "default",
                        "outcome": "ok" if ok else "failed",
                        "reason": "" if ok else "probe exited 1: CUDA error: out of memory",
                        "started_at": started_at,
                        "ended_at": started_at + timedelta(seconds=12.5),
                        "duration_seconds": 12.5,
                        "iterations": 600,
                        "throughput": steady * 1.05 if ok else None,
                        "unit": unit,
                        "exit_code": 0 if ok else 1,
                        "manifest": manifest(workload, precision, unit, model, f"gpu{gpu}"),
                        "result": json.dumps({"event": "result", "throughput": steady * 1.05}),
                        "stderr_tail": "",
                        "classification": "flat" if ok else None,
                        "peak_throughput": steady * 1.08 if ok else None,
                        "steady_throughput": steady if ok else None,
                        "steady_ci_low": steady * 0.999 if ok else None,
                        "steady_ci_high": steady * 1.001 if ok else None,
                        "sustained_ratio": 1 / 1.08 if ok else None,
                        "steady_start_index": 12 if ok else None,
                        "warmup_seconds": 0.4 if ok else None,
                        "cause": "not clock-bound" if ok else None,
                        "work_per_joule": steady / 700.0 if ok else None,
                        "analysis": analysis(steady, steady * 1.08) if ok else None,
                        "stack_id": STACKS[stack],
                        "device_model": model,
                        "steady_sm_clock_hertz": 1.755e9 if ok else None,
                        "steady_temperature_celsius": 71.0 if ok else None,
                        "steady_power_watts": 700.0 if ok else None,
                        "steady_thermal_share": 0.0 if ok else None,
                        "steady_power_share": 0.8 if ok else None,
                    }
                )
        yield chunk


def load_sqlite(engine: Engine, chunks: Iterator[list[dict[str, Any]]]) -> None:
    """executemany of plain tuples, in chunks, in one transaction; datetimes converted as the
    model's own type converts them, so the rows read back exactly as the agent's would."""
    dialect = engine.dialect
    table = ProbeRunRecord.__table__
    processors: dict[str, Callable[[Any], Any]] = {}
    for name in ("started_at", "ended_at"):
        bind = table.c[name].type.bind_processor(dialect)
        assert bind is not None
        processors[name] = bind
    names = ", ".join(COLUMNS)
    marks = ", ".join("?" for _ in COLUMNS)
    statement = f"INSERT INTO probe_runs ({names}) VALUES ({marks})"
    with engine.begin() as connection:
        batch: list[tuple[Any, ...]] = []
        for chunk in chunks:
            for run in chunk:
                for name, processor in processors.items():
                    run[name] = processor(run[name])
                batch.append(tuple(run[name] for name in COLUMNS))
            if len(batch) >= CHUNK:
                connection.exec_driver_sql(statement, batch)
                batch = []
        if batch:
            connection.exec_driver_sql(statement, batch)


def load_postgresql(engine: Engine, chunks: Iterator[list[dict[str, Any]]]) -> None:
    """COPY through psycopg, in one transaction, then VACUUM ANALYZE (autovacuum's work)."""
    raw = engine.raw_connection()
    try:
        connection: Any = raw.driver_connection
        with connection.transaction(), connection.cursor() as cursor:
            names = ", ".join(COLUMNS)
            with cursor.copy(f"COPY probe_runs ({names}) FROM STDIN") as copy:
                for chunk in chunks:
                    for run in chunk:
                        copy.write_row(tuple(run[name] for name in COLUMNS))
        connection.autocommit = True
        connection.execute("VACUUM ANALYZE probe_runs")
        connection.autocommit = False
    finally:
        raw.close()


def queries(now: datetime) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("--by model", {"by": "model"}),
        ("--by model --precision bf16", {"by": "model", "precision": "bf16"}),
        ("--by node --precision bf16", {"by": "node", "precision": "bf16"}),
        ("--by stack --since 7d", {"by": "stack", "since": parse_since("7d", now)}),
    ]


def measure(engine: Engine, now: datetime) -> list[tuple[float, int]]:
    """Best of REPEATS wall times of each query, and the number of rows it answered."""
    figures = []
    for _, arguments in queries(now):
        times, rows = [], 0
        for _ in range(REPEATS):
            started = time.perf_counter()
            rows = len(capacity(engine, **arguments))
            times.append(time.perf_counter() - started)
        figures.append((min(times), rows))
    return figures


def bench_backend(
    backend: str, total: int, now: datetime, work: Path
) -> tuple[float, list[tuple[float, int]]]:
    """The load time and the figures of each query."""
    admin: Engine | None = None
    name = f"sustain_bench_{uuid.uuid4().hex[:12]}"
    if backend == "sqlite":
        url = f"sqlite:///{work / 'archive.db'}"
    else:
        admin = create_engine(POSTGRES_MAINTENANCE_URL, isolation_level="AUTOCOMMIT")
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
        url = f"{POSTGRES_SERVER}/{name}"
    engine = open_engine(url)
    try:
        upgrade(engine)
        started = time.perf_counter()
        if backend == "sqlite":
            load_sqlite(engine, runs(total, now))
        else:
            load_postgresql(engine, runs(total, now))
        loaded = time.perf_counter() - started
        print(f"{backend}: loaded in {loaded:.0f} s", file=sys.stderr)
        return loaded, measure(engine, now)
    finally:
        engine.dispose()
        if admin is not None:
            with admin.connect() as connection:
                connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            admin.dispose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=int, default=1_000_000)
    parser.add_argument(
        "--backend", nargs="+", choices=["sqlite", "postgresql"], default=["sqlite", "postgresql"]
    )
    args = parser.parse_args()
    now = datetime.now(UTC)
    figures: dict[str, list[tuple[float, int]]] = {}
    load_seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as work:
        for backend in args.backend:
            load_seconds[backend], figures[backend] = bench_backend(
                backend, args.results, now, Path(work)
            )
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus, Python "
        f"{platform.python_version()}, SQLAlchemy {sqlalchemy.__version__}; "
        f"{args.results:,} results; best of {REPEATS}; target {TARGET_S:g} s"
    )
    print("| query | " + " | ".join(f"{backend} s" for backend in args.backend) + " | rows |")
    print("|---|" + "---|" * len(args.backend) + "---|")
    for index, (label, _) in enumerate(queries(now)):
        cells = " | ".join(f"{figures[backend][index][0]:.3f}" for backend in args.backend)
        print(f"| `{label}` | {cells} | {figures[args.backend[0]][index][1]} |")
    result = {
        "results": args.results,
        "repeats": REPEATS,
        "target_s": TARGET_S,
        "load_seconds": load_seconds,
        "backends": {
            backend: [
                {"query": label, "seconds": seconds, "rows": rows}
                for (label, _), (seconds, rows) in zip(queries(now), figures[backend], strict=True)
            ]
            for backend in args.backend
        },
    }
    print("RESULT " + json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
