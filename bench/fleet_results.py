"""bench/fleet_scale.py --results N: N probe results loaded on the server, and the reports'
query times over them (`sustain capacity --by model`, and `--since 7d` as the CLI answers it
with the runs left out; `sustain drift`'s query over the whole fleet, skipped with
--drift-repeats 0), each capacity answer compared once with the unsummarised query's (every
result read by PostgreSQL: what the summary must equal to the last bit)."""

from __future__ import annotations

import argparse
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, text

from agent.archive.database import current_revision, head_revision, open_engine, upgrade
from agent.reports import capacity as capacity_module
from agent.reports.capacity import Capacity, capacity, capacity_with_runs, parse_since
from agent.reports.specs import spec_peak

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


from fleet_model import (  # noqa: E402  (bench/, this script's folder)
    EFFICIENCY,
    FAILED_SHARE,
    FLEET_NODES,
    GPUS,
    LOAD_CHUNK,
    MODELS,
    POSTGRES_SERVER,
    PRECISIONS,
    RESULT_DAYS,
    RESULTS_DATABASE,
    STACK_FACTORS,
    STACKS,
    create_database,
    drop_database,
)


def catalogue() -> list[tuple[int, int, str, str, str, str, float]]:
    """(model index, probe index, model, workload, precision, unit, steady) of every probe a
    model's nodes run: matmul in the precisions its spec has, and membw."""
    rows = []
    for model_index, (model, _) in enumerate(MODELS):
        probes = [("matmul", p, "FLOP/s") for p in PRECISIONS] + [("membw", "fp32", "B/s")]
        probes = [p for p in probes if spec_peak(model, *p) is not None]
        for probe_index, (workload, precision, unit) in enumerate(probes):
            peak = spec_peak(model, workload, precision, unit) or 0.0
            efficiency = 0.85 if workload == "membw" else EFFICIENCY[precision]
            rows.append(
                (model_index, probe_index, model, workload, precision, unit, peak * efficiency)
            )
    return rows


def load_sql(first: int, last: int, results: int, now: datetime, *, lean: bool = False) -> str:
    """INSERT ... SELECT of results first..last of ``results``, made on the server, in the order
    they ended (result g at g/results of the 90 days, within one step), as agents write them: a
    day's results lie together in its month's partition, as in a fleet's archive. ``lean``:
    without the manifest, result and analysis JSON (which no report query reads), to load 10
    million results in minutes on a small machine."""
    probes = catalogue()
    counts = {m: sum(1 for p in probes if p[0] == m) for m in range(len(MODELS))}
    values = ", ".join(
        f"({m}, {p}, '{model}', '{workload}', '{precision}', '{unit}', {steady!r})"
        for m, p, model, workload, precision, unit, steady in probes
    )
    bounds, total = [], 0.0
    for index, (_, share) in enumerate(MODELS):
        total += share
        bounds.append(f"WHEN node_index < {int(total * FLEET_NODES)} THEN {index}")
    model_case = "CASE " + " ".join(bounds) + f" ELSE {len(MODELS) - 1} END"
    probe_count = (
        "CASE model_index " + " ".join(f"WHEN {m} THEN {n}" for m, n in counts.items()) + " END"
    )
    stacks = "ARRAY[" + ", ".join(f"'{s}'" for s in STACKS) + "]"
    factors = "ARRAY[" + ", ".join(repr(f) for f in STACK_FACTORS) + "]::float8[]"
    manifest = (
        "json_build_object('event', 'manifest', 'workload', r.workload, 'version', 1, "
        "'precision', r.precision, 'optimization', 'eager', 'size', 'default', 'unit', r.unit, "
        "'work_unit', CASE r.unit WHEN 'B/s' THEN 'byte' ELSE 'flop' END, 'device', "
        "json_build_object('kind', 'cuda', 'label', 'gpu' || r.gpu, 'device_name', r.model, "
        "'memory', 85e9), 'device_name', r.model, 'parameters', json_build_object('m', 8192, "
        "'n', 8192, 'k', 8192, 'repeats', 10), 'torch', '2.5.1+cu124', 'cuda', '12.4', "
        "'duration', 20.0)::text"
    )
    analysis = (
        "json_build_object('classification', 'flat', 'n', 1200, 'steady_start_index', 12, "
        "'steady_throughput', r.steady, 'steady_ci', json_build_array(r.steady * 0.999, "
        "r.steady * 1.001), 'peak_throughput', r.steady * 1.04, 'sustained_ratio', 1 / 1.04, "
        "'changepoints', json_build_array(12), 'warmup_seconds', 0.4, 'mser5_index', 10, "
        "'outliers', 3, 'tolerance', 0.02, 'reason', "
        "'one steady regime after 0.4 s of warm-up, within 2.0%', 'phase', 'measure', "
        "'attribution', json_build_object('cause', NULL, 'reason', 'flat: no slowdown to explain',"
        " 'work_per_joule', r.steady / 700, 'segments', json_build_array(json_build_object("
        "'sm_clock_hertz', 1.98e9, 'power_watts', 650, 'temperature_celsius', 60, "
        "'reason_share', json_build_object()), json_build_object('sm_clock_hertz', 1.755e9, "
        "'power_watts', 700, 'temperature_celsius', 71, 'reason_share', "
        "json_build_object('sw_power_cap', 0.8)))))::text"
    )
    if lean:
        manifest, analysis = "NULL", "NULL"
    start = (now - timedelta(days=RESULT_DAYS)).isoformat()
    return f"""
INSERT INTO probe_runs (run_id, node, device, device_label, workload, precision, optimization,
  size, scope, outcome, reason, started_at, ended_at, duration_seconds, iterations, throughput,
  unit, exit_code, manifest, result, stderr_tail, classification, peak_throughput,
  steady_throughput, steady_ci_low, steady_ci_high, sustained_ratio, steady_start_index,
  warmup_seconds, cause, work_per_joule, analysis, stack_id, device_model,
  steady_sm_clock_hertz, steady_temperature_celsius, steady_power_watts, steady_thermal_share,
  steady_power_share, p10_throughput, p50_throughput)
WITH catalogue (model_index, probe_index, model, workload, precision, unit, steady) AS
  (VALUES {values}),
picked AS (
  SELECT g, device_index, device_index / {GPUS} AS node_index, device_index % {GPUS} AS gpu,
         offset_days, failed, noise, probe_pick
  FROM (SELECT g, floor(random() * {FLEET_NODES * GPUS})::int AS device_index,
               {RESULT_DAYS} * (g - random()) / {results} AS offset_days,
               random() < {FAILED_SHARE} AS failed,
               1 + 0.01 * (random() + random() + random() + random() - 2) * 1.7 AS noise,
               random() AS probe_pick
        FROM generate_series({first}, {last}) AS g) AS drawn
),
modelled AS (
  SELECT *, {model_case} AS model_index FROM picked
),
r AS (
  SELECT m.*, floor(m.probe_pick * ({probe_count}))::int AS probe_index,
         least(3, floor((m.offset_days + (m.node_index % 20)) / 25))::int + 1 AS stack,
         'fleet-node-' || lpad(m.node_index::text, 5, '0') AS node,
         'GPU-' || md5('gpu' || m.device_index)::uuid AS device,
         timestamptz '{start}' + m.offset_days * interval '1 day' AS started_at
  FROM modelled AS m
),
s AS (
  SELECT r.*, c.model, c.workload, c.precision, c.unit,
         c.steady * ({factors})[r.stack] * r.noise
           * CASE WHEN r.device_index % 50 = 7 THEN 0.85 ELSE 1.0 END AS value
  FROM r JOIN catalogue AS c USING (model_index, probe_index)
)
SELECT md5('run' || r.g), r.node, r.device, 'gpu' || r.gpu, r.workload, r.precision, 'eager',
  'default', 'device', CASE WHEN r.failed THEN 'failed' ELSE 'ok' END,
  CASE WHEN r.failed THEN 'probe exited 1: CUDA error: out of memory' ELSE '' END,
  r.started_at, r.started_at + interval '21.5 seconds', 21.5, 1200,
  CASE WHEN r.failed THEN NULL ELSE r.value * 1.01 END, r.unit,
  CASE WHEN r.failed THEN 1 ELSE 0 END, {manifest},
  CASE WHEN r.failed OR {lean} THEN NULL ELSE json_build_object('event', 'result',
    'throughput', r.value * 1.01)::text END,
  '', CASE WHEN r.failed THEN NULL ELSE 'flat' END,
  CASE WHEN r.failed THEN NULL ELSE r.value * 1.04 END,
  CASE WHEN r.failed THEN NULL ELSE r.value END,
  CASE WHEN r.failed THEN NULL ELSE r.value * 0.999 END,
  CASE WHEN r.failed THEN NULL ELSE r.value * 1.001 END,
  CASE WHEN r.failed THEN NULL ELSE 1 / 1.04 END, CASE WHEN r.failed THEN NULL ELSE 12 END,
  CASE WHEN r.failed THEN NULL ELSE 0.4 END, NULL,
  CASE WHEN r.failed THEN NULL ELSE r.value / 700 END,
  CASE WHEN r.failed THEN NULL ELSE {analysis} END,
  ({stacks})[r.stack], r.model,
  CASE WHEN r.failed THEN NULL ELSE 1.755e9 END, CASE WHEN r.failed THEN NULL ELSE 71.0 END,
  CASE WHEN r.failed THEN NULL ELSE 700.0 END, CASE WHEN r.failed THEN NULL ELSE 0.0 END,
  CASE WHEN r.failed THEN NULL ELSE 0.8 END,
  CASE WHEN r.failed THEN NULL ELSE r.value * 0.99 END,
  CASE WHEN r.failed THEN NULL ELSE r.value END
FROM (SELECT s.g, s.node, s.device, s.gpu, s.workload, s.precision, s.unit, s.model, s.failed,
             s.started_at, s.stack, s.value, s.value AS steady FROM s) AS r
"""


def ensure_partitions(engine: Engine, now: datetime) -> None:
    """The months of the load, where the schema partitions probe_runs (the writers make the
    month of a row they write; a server-side load must make them first)."""
    try:
        from agent.archive import partitions  # noqa: PLC0415 - the partitioned schema only
    except ImportError:
        return
    months = [now - timedelta(days=day) for day in range(0, RESULT_DAYS + 31, 15)]
    with engine.begin() as connection:
        if partitions.is_partitioned(connection, "probe_runs"):
            partitions.ensure_for(connection, "probe_runs", months)


def rebuild_summary(engine: Engine) -> str:
    try:
        from agent.archive import summary  # noqa: PLC0415 - there from migration 0010 on
    except ImportError:
        return "the summary was not rebuilt: agent.archive.summary does not exist yet"
    started = time.perf_counter()
    with engine.begin() as connection:
        connection.exec_driver_sql("SET LOCAL statement_timeout = 0")  # minutes at 10 M
        summary.rebuild(connection)
        connection.exec_driver_sql("ANALYZE")  # the summary's tables, as autovacuum would
    return f"summary rebuilt in {time.perf_counter() - started:.0f} s"


def load_results(
    engine: Engine, total: int, now: datetime, *, lean: bool = False
) -> dict[str, float]:
    ensure_partitions(engine, now)
    timings: dict[str, float] = {}
    started = time.perf_counter()
    raw = engine.raw_connection()
    try:
        connection: Any = raw.driver_connection
        connection.autocommit = True
        connection.execute("SET statement_timeout = 0")  # a chunk is minutes of work
        connection.execute("SET session_replication_role = replica")
        connection.execute("SELECT setseed(0.42)")
        for first in range(1, total + 1, LOAD_CHUNK):
            last = min(total, first + LOAD_CHUNK - 1)
            connection.execute(load_sql(first, last, total, now, lean=lean))
            print(
                f"loaded {last:,} results in {time.perf_counter() - started:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        connection.execute("SET session_replication_role = DEFAULT")
        timings["load_s"] = time.perf_counter() - started
        started = time.perf_counter()
        connection.execute("VACUUM ANALYZE probe_runs")
        timings["vacuum_analyze_s"] = time.perf_counter() - started
    finally:
        raw.close()
    return timings


def best_of(repeats: int, work: Any) -> tuple[float, Any]:
    times, answer = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        answer = work()
        times.append(time.perf_counter() - started)
    return min(times), answer


def unsummarised(engine: Engine, **query: Any) -> tuple[float, Capacity]:
    """The query without the summary (as tests/test_fleet_scale.py runs it), and its time."""
    summarised = capacity_module._summarised
    capacity_module._summarised = lambda connection: False
    try:
        started = time.perf_counter()
        answer = capacity_with_runs(engine, **query)
        return time.perf_counter() - started, answer
    finally:
        capacity_module._summarised = summarised


def results_run(args: argparse.Namespace) -> dict[str, Any]:
    from agent.drift.detect import load_history  # noqa: PLC0415 - numpy and scipy: this mode only

    database = args.database or RESULTS_DATABASE
    url = f"{POSTGRES_SERVER}/{database}"
    now = datetime.now(UTC)
    timings: dict[str, float] = {}
    summary_note = "reused: not rebuilt"
    loaded = 0
    if args.reuse:
        engine = open_engine(url)
        if current_revision(engine) != head_revision():
            raise SystemExit(f"{database} is not at {head_revision()}: load it again")
    else:
        create_database(database)
        engine = open_engine(url)
        upgrade(engine)
        timings = load_results(engine, args.results, now, lean=args.lean)
        started = time.perf_counter()
        summary_note = rebuild_summary(engine)
        timings["summary_s"] = time.perf_counter() - started
    try:
        with engine.connect() as connection:
            loaded = connection.execute(text("SELECT COUNT(*) FROM probe_runs")).scalar_one()
            size = connection.execute(
                text("SELECT pg_database_size(current_database())")
            ).scalar_one()
        print(summary_note, file=sys.stderr, flush=True)
        capacity_s, rows = best_of(args.repeats, lambda: capacity(engine, by="model"))
        print(f"capacity --by model: {capacity_s:.3f} s", file=sys.stderr, flush=True)
        # The week before the latest result (the load ends at its start time).
        since = parse_since("7d", now)
        since_s, week = best_of(
            args.repeats, lambda: capacity_with_runs(engine, by="model", since=since)
        )
        print(f"capacity --by model --since 7d: {since_s:.3f} s", file=sys.stderr, flush=True)
        compared = {}
        for name, query, answer in (
            ("by_model", {"by": "model"}, capacity_with_runs(engine, by="model")),
            ("since_7d", {"by": "model", "since": since}, week),
        ):
            seconds, expected = unsummarised(engine, **query)
            compared[name] = {"unsummarised_s": seconds, "equal": answer == expected}
            print(f"unsummarised {name}: {compared[name]}", file=sys.stderr, flush=True)
        drift_repeats = args.repeats if args.drift_repeats is None else args.drift_repeats
        drift_s, history = (
            best_of(drift_repeats, lambda: load_history(engine, history=500))
            if drift_repeats
            else (None, [])
        )
    finally:
        engine.dispose()
        if not (args.keep or args.reuse):
            drop_database(database)
    return {
        "results": loaded,
        "database": database,
        "database_bytes": size,
        "kept": args.keep,
        "summary": summary_note,
        "lean": args.lean,
        "timings": timings,
        "repeats": args.repeats,
        "capacity_by_model_s": capacity_s,
        "capacity_rows": len(rows),
        "capacity_since_7d_s": since_s,
        "capacity_since_7d_rows": len(week.rows),
        "compared": compared,
        "drift_load_history_s": drift_s,
        "drift_repeats": drift_repeats,
        "drift_series": len(history),
    }


def print_results(r: dict[str, Any]) -> None:
    t = r["timings"]
    print(
        f"\n{r['results']:,} probe results of {FLEET_NODES:,} nodes over {RESULT_DAYS} days "
        f"({r['database_bytes'] / 2**30:.1f} GiB database); best of {r['repeats']}\n"
    )
    print("| figure | value |")
    print("|---|---|")
    if t:
        print(
            f"| load (INSERT ... SELECT, triggers off) | {t['load_s']:.0f} s, "
            f"VACUUM ANALYZE {t['vacuum_analyze_s']:.0f} s; {r['summary']} |"
        )
    print(
        f"| `sustain capacity --by model` | {r['capacity_by_model_s']:.3f} s "
        f"({r['capacity_rows']} rows) |"
    )
    print(
        f"| `sustain capacity --by model --since 7d` (with the runs left out) | "
        f"{r['capacity_since_7d_s']:.3f} s ({r['capacity_since_7d_rows']} rows) |"
    )
    for name, c in r["compared"].items():
        print(
            f"| the same {name.replace('_', ' ')} unsummarised (every result read) | "
            f"{c['unsummarised_s']:.1f} s; {'equal' if c['equal'] else 'DIFFERENT'} |"
        )
    if r["drift_repeats"]:
        print(
            f"| `sustain drift`'s query (load_history, 500 a series), best of "
            f"{r['drift_repeats']} | {r['drift_load_history_s']:.2f} s "
            f"({r['drift_series']:,} series) |"
        )
