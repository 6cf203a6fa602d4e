"""A 10,000-node fleet on one PostgreSQL: the agents' writes, and the reports at 10 M results.

    .venv/bin/python bench/fleet_scale.py [--agents 200] [--minutes 5] [--nodes 10000] [--rollups]
    .venv/bin/python bench/fleet_scale.py --results 10000000 [--keep] [--reuse]
    .venv/bin/python bench/fleet_scale.py --results 10000000 --keep --readers 50 (or --reuse)

Traffic (the default): --agents writer processes, each one agent with its own node name, its own
spool file and its own ArchiveSink draining into a fresh database through a private PgBouncer in
transaction mode (tests/pgbouncer_server.py; --direct for none), as a fleet runs it
(docs/scale.md). Time is compressed by --nodes / --agents, so that the agents together hand over
what --nodes nodes would: each agent lives that many seconds of node time per second. What a node
hands over comes from the agent's defaults (agent/config/settings.py), printed at the start:

- probe runs: the default probe plan on each of --gpus GPUs (solo runs), each a start and a
  finish with its manifest, result, analysis (with its attribution) and its iteration series
  (JSON): about 60 iterations a second for matmul bf16 and 70 for membw on an H100, 6 for matmul
  fp32; 3 % of runs fail (no analysis, a short series);
- events: throttle episodes (THROTTLE_PER_GPU_HOUR, an assumption: a loaded GPU at its power cap),
  health changes, XIDs, stack changes (HEALTH_PER_NODE_DAY, XID_PER_NODE_DAY,
  STACK_CHANGES_PER_NODE_DAY), one event per hand-over as the sampler gives them;
- a stack snapshot (and its stack_changed event) when the agent starts, and at each stack change;
- with --rollups, the per-minute rollups (one row per series: one per NVML field of each GPU and
  40 host ones). Off by default: a fleet keeps dense telemetry in Prometheus, not in PostgreSQL.

Each agent counts what it handed over; at the end the bench checks the database: every run id
once (finished) with its series once, every event id once, no other row, every spool empty, no
item rejected, no write error. Reported: row writes (inserts, and a finish's update of its run)
and items a second (handed over in the window; stored, over the window and the drain after it),
the time of each spool item's apply (the sink's own per-item step, from the spool read to the
delete after the commit: connection, statements, commit) and of each item's wait from hand-over
to stored, p50 and p99; the bytes of the tables (pg_total_relation_size) per simulated node-day;
the machine's CPU over the window, and the CPU seconds of the agents, of the PostgreSQL backends
serving the database and of PgBouncer (the agents share the machine with the database here; in a
fleet they run on their nodes).

Results (--results N): N probe results of a 10,000-node fleet over 90 days (8 GPUs a node, H100,
H200, A100 and L40S nodes, the probes spec'd for each model, four stacks rolled out node by node,
2 % slow GPUs, 3 % failed runs; manifest and analysis JSON as the agent writes them), in the
order they ended (as agents write them), loaded on the server with INSERT ... SELECT FROM
generate_series, with triggers off (session_replication_role = replica), then
agent.archive.summary.rebuild where it exists, VACUUM ANALYZE; then `sustain capacity --by
model` (agent.reports.capacity.capacity) and the query of `sustain drift`
(agent.drift.detect.load_history), best of --repeats each. --keep keeps the
database, --reuse times a kept one again without loading (and keeps it).

Readers (--readers N, with --keep or --reuse): what every node reads from that database each
hour, the fleet's pass once, and N nodes' drift child and health baseline reads (bench/
fleet_readers.py).

Prints a markdown table, and as its last line `RESULT {json}` for bench/run_all.py.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.connection
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import sqlalchemy
from sqlalchemy import Connection, Engine, create_engine, text

from agent.archive.database import open_engine, upgrade

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fleet_model import (  # noqa: E402  (bench/, this script's folder)
    DAY,
    DRAIN_TIMEOUT_S,
    FAILED_SHARE,
    FLEET_NODES,
    GPUS,
    HEALTH_PER_NODE_DAY,
    HOUR,
    POSTGRES_MAINTENANCE_URL,
    POSTGRES_SERVER,
    STACK_CHANGES_PER_NODE_DAY,
    THROTTLE_PER_GPU_HOUR,
    TRAFFIC_DATABASE,
    XID_PER_NODE_DAY,
    AgentPlan,
    Handed,
    create_database,
    drop_database,
    quantile,
    rates,
    run_agent,
)
from fleet_readers import print_readers, readers_run  # noqa: E402
from fleet_results import print_results, results_run  # noqa: E402
from pgbouncer_server import PgBouncer, PgBouncerError  # noqa: E402  (tests/ is on the path)
from run_all import cpu_model, postgres_version  # noqa: E402


def table_bytes(engine: Engine) -> dict[str, int]:
    """pg_total_relation_size of each table, partitions counted with their parent."""
    query = text(
        "SELECT COALESCE(parent.relname, c.relname), SUM(pg_total_relation_size(c.oid)) "
        "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "LEFT JOIN pg_inherits i ON i.inhrelid = c.oid "
        "LEFT JOIN pg_class parent ON parent.oid = i.inhparent "
        "WHERE n.nspname = 'public' AND c.relkind = 'r' GROUP BY 1"
    )
    with engine.connect() as connection:
        return {name: int(size) for name, size in connection.execute(query).all()}


def counted(connection: Connection, query: str) -> dict[str, int]:
    return {str(key): int(count) for key, count in connection.execute(text(query))}


def check(engine: Engine, agents: list[Handed]) -> dict[str, Any]:
    """Every handed-over id once, nothing else; the counts."""
    runs = {run for agent in agents for run in agent.runs}
    events = {e for agent in agents for e in agent.events}
    with engine.connect() as connection:
        stored_runs = counted(connection, "SELECT run_id, COUNT(*) FROM probe_runs GROUP BY 1")
        series = counted(connection, "SELECT run_id, COUNT(*) FROM probe_series GROUP BY 1")
        stored_events = counted(connection, "SELECT event_id, COUNT(*) FROM events GROUP BY 1")
        stacks = set(
            connection.execute(text("SELECT stack_id FROM stack_snapshots")).scalars().all()
        )
        running = connection.execute(
            text("SELECT COUNT(*) FROM probe_runs WHERE outcome = 'running'")
        ).scalar_one()
        rollups = connection.execute(text("SELECT COUNT(*) FROM telemetry_rollups")).scalar_one()
    finished = sum(len(agent.runs) for agent in agents) - running
    problems = []
    if stored_runs != dict.fromkeys(runs, 1):
        problems.append(
            f"runs: {len(runs)} handed over, {len(stored_runs)} stored, "
            f"{sum(1 for n in stored_runs.values() if n > 1)} doubled"
        )
    if set(series) - runs or any(n != 1 for n in series.values()) or len(series) < finished:
        problems.append(f"series: {len(series)} stored for {finished} finished runs")
    if stored_events != dict.fromkeys(events, 1):
        problems.append(f"events: {len(events)} handed over, {len(stored_events)} stored")
    if stacks != {s for agent in agents for s in agent.stacks}:
        problems.append(f"stacks: {sorted(stacks)}")
    if rollups != sum(agent.rollup_rows for agent in agents):
        problems.append(f"rollups: {rollups} stored")
    for agent in agents:
        if not agent.empty or agent.spool_items or agent.rejected or agent.write_errors:
            problems.append(
                f"{agent.node}: spool {agent.spool_items} items left, "
                f"{agent.rejected} rejected, {agent.write_errors} write errors"
            )
    return {
        "runs": len(stored_runs),
        "runs_still_running": running,
        "series": len(series),
        "events": len(stored_events),
        "stacks": len(stacks),
        "rollup_rows": rollups,
        "rejected": sum(agent.rejected for agent in agents),
        "write_errors": sum(agent.write_errors for agent in agents),
        "spool_items_left": sum(agent.spool_items for agent in agents),
        "problems": problems,
    }


@dataclass
class Window:
    """The traffic's wall-clock window and what the machine did during it."""

    start_at: float = 0.0
    cpu_before: Any = None
    cpu_after: Any = None
    load: tuple[float, float] = (0.0, 0.0)
    by_process_before: dict[int, tuple[str, float]] = field(default_factory=dict)
    by_process_after: dict[int, tuple[str, float]] = field(default_factory=dict)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds over the window of the agents, the PostgreSQL backends serving the bench's
        database (not the server's shared WAL writer and checkpointer) and PgBouncer; a process
        that started in the window counts from zero."""
        spent: dict[str, float] = {"agents": 0.0, "postgresql": 0.0, "pgbouncer": 0.0}
        for pid, (group, seconds) in self.by_process_after.items():
            before = self.by_process_before.get(pid)
            spent[group] += seconds - (before[1] if before and before[0] == group else 0.0)
        return spent

    def cpu_busy_percent(self) -> float:
        """Busy share of all CPUs (iowait counts as idle)."""
        fields = ("user", "system", "nice", "irq", "softirq", "steal")
        busy = sum(getattr(self.cpu_after, f) - getattr(self.cpu_before, f) for f in fields)
        total = sum(self.cpu_after) - sum(self.cpu_before)
        return 100 * busy / total if total else float("nan")


def process_cpu(database: str) -> dict[int, tuple[str, float]]:
    """Each agent's process, each backend of ``database`` and PgBouncer: its group and its CPU
    seconds so far."""
    engine = create_engine(POSTGRES_MAINTENANCE_URL)
    try:
        with engine.connect() as connection:
            query = text("SELECT pid FROM pg_stat_activity WHERE datname = :name")
            backends = set(connection.execute(query, {"name": database}).scalars())
    finally:
        engine.dispose()
    groups = {pid: "postgresql" for pid in backends}
    for child in psutil.Process().children():
        groups[child.pid] = "pgbouncer" if child.name() == "pgbouncer" else "agents"
    found = {}
    for pid, group in groups.items():
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        found[pid] = (group, times.user + times.system)
    return found


def run_agents(args: argparse.Namespace, url: str, work: Path, window: Window) -> list[Handed]:
    """Start the agent processes, start them together once all are ready, collect their reports."""
    seconds = args.minutes * 60
    context = multiprocessing.get_context("fork")
    start = (context.Event(), context.Value("d", 0.0))
    pipes, processes = [], []
    for index in range(args.agents):
        plan = AgentPlan(
            index,
            url,
            work / f"spool-{index}.db",
            seconds,
            args.nodes / args.agents,
            args.gpus,
            args.rollups,
        )
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=run_agent, args=(plan, start, send), name=f"agent-{index}")
        process.start()
        send.close()
        pipes.append(receive)
        processes.append(process)
    try:
        for pipe in pipes:  # every agent connected, its spool open
            if pipe.recv() != "ready":
                raise SystemExit("an agent did not start")
        window.start_at = time.time() + 1.0
        start[1].value = window.start_at
        start[0].set()
        time.sleep(max(0.0, window.start_at - time.time()))
        window.by_process_before = process_cpu(url.rsplit("/", 1)[1])
        window.cpu_before, load_before = psutil.cpu_times(), os.getloadavg()[0]
        time.sleep(seconds)
        window.cpu_after, window.load = psutil.cpu_times(), (load_before, os.getloadavg()[0])
        window.by_process_after = process_cpu(url.rsplit("/", 1)[1])
        return [pipe.recv() for pipe in pipes]
    finally:
        for process in processes:
            process.join(DRAIN_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()


def traffic(args: argparse.Namespace) -> dict[str, Any]:
    compression = args.nodes / args.agents
    seconds = args.minutes * 60
    per_node = rates(args.gpus)
    shown = {k: v for k, v in per_node.items() if args.rollups or k != "rollup_rows"}
    print(
        f"per node of {args.gpus} GPUs (agent defaults; events assumed): "
        + ", ".join(f"{value:,.2f} {name}/h" for name, value in shown.items())
    )
    print(
        f"{args.agents} agents x {compression:g} node-seconds a second = {args.nodes:,} nodes; "
        f"{args.minutes:g} min = {seconds * compression / HOUR:.2f} node-hours per agent",
        flush=True,
    )
    database = args.database or TRAFFIC_DATABASE
    create_database(database)
    engine = open_engine(f"{POSTGRES_SERVER}/{database}")
    work = Path(tempfile.mkdtemp(prefix="sustain-fleet-"))
    bouncer = (
        None
        if args.direct
        else PgBouncer(work, default_pool_size=args.pool_size, max_client_conn=args.agents + 50)
    )
    window = Window()
    try:
        upgrade(engine)
        before = table_bytes(engine)
        engine.dispose()  # no pooled connection crosses the fork
        if bouncer is not None:
            bouncer.start()
        url = f"{POSTGRES_SERVER}/{database}" if bouncer is None else bouncer.url(database)
        agents = run_agents(args, url, work, window)
        ended = max(agent.last_applied for agent in agents)
        after = table_bytes(engine)
        counts = check(engine, agents)
    finally:
        if bouncer is not None:
            bouncer.stop()
        engine.dispose()
        shutil.rmtree(work, ignore_errors=True)
        if not args.keep:
            drop_database(database)
    start_at = window.start_at
    spent = window.cpu_seconds()
    in_window = sum(agent.items - agent.backlog_at_end for agent in agents)
    items = sum(agent.items for agent in agents)
    rows = sum(agent.rows for agent in agents)
    applies = [s for agent in agents for s in agent.apply_seconds]
    waits = [s for agent in agents for s in agent.wait_seconds]
    stored_bytes = sum(after.values()) - sum(before.values())
    node_days = args.agents * seconds * compression / DAY
    return {
        "agents": args.agents,
        "nodes": args.nodes,
        "gpus": args.gpus,
        "minutes": args.minutes,
        "compression": compression,
        "rollups": args.rollups,
        "pgbouncer": None
        if args.direct
        else {"pool_mode": "transaction", "default_pool_size": args.pool_size},
        "per_node_per_hour": per_node,
        "assumptions": {
            "throttle_per_gpu_hour": THROTTLE_PER_GPU_HOUR,
            "health_changes_per_node_day": HEALTH_PER_NODE_DAY,
            "xids_per_node_day": XID_PER_NODE_DAY,
            "stack_changes_per_node_day": STACK_CHANGES_PER_NODE_DAY,
            "failed_share": FAILED_SHARE,
        },
        "items": items,
        "rows": rows,
        "offered_items_per_s": items / seconds,
        "offered_rows_per_s": rows / seconds,
        "stored_items_per_s": items / (ended - start_at),
        "stored_rows_per_s": rows / (ended - start_at),
        "drain_after_window_s": ended - (start_at + seconds),
        "backlog_at_end_items": sum(agent.backlog_at_end for agent in agents),
        "worst_schedule_lag_s": max(agent.behind_seconds for agent in agents),
        "apply_ms": {
            "p50": 1e3 * quantile(applies, 0.5),
            "p99": 1e3 * quantile(applies, 0.99),
            "max": 1e3 * max(applies),
            "count": len(applies),
        },
        "wait_ms": {"p50": 1e3 * quantile(waits, 0.5), "p99": 1e3 * quantile(waits, 0.99)},
        "table_bytes": {name: after[name] - before.get(name, 0) for name in sorted(after)},
        "node_days": node_days,
        "bytes_per_node_day": stored_bytes / node_days,
        "cpu_busy_percent": window.cpu_busy_percent(),
        "cpu_seconds": spent,
        "postgresql_cpu_ms_per_item": 1e3 * spent["postgresql"] / max(1, in_window),
        "load_average": list(window.load),
        "check": counts,
    }


def print_traffic(r: dict[str, Any]) -> None:
    c = r["check"]
    apply, wait, cpu = r["apply_ms"], r["wait_ms"], r["cpu_seconds"]
    pool = r["pgbouncer"]
    path = (
        "direct"
        if pool is None
        else f"PgBouncer, transaction mode, {pool['default_pool_size']} server connections"
    )
    print(
        f"\n{r['agents']} agents ({path}), {r['minutes']:g} min, as {r['nodes']:,} nodes of "
        f"{r['gpus']} GPUs; rollups {'on' if r['rollups'] else 'off'}\n"
    )
    print("| figure | value |")
    print("|---|---|")
    rows = [
        (
            "handed over (the traffic of the fleet)",
            f"{r['offered_rows_per_s']:,.0f} rows/s, {r['offered_items_per_s']:,.0f} items/s",
        ),
        (
            "stored (window and the drain after it)",
            f"{r['stored_rows_per_s']:,.0f} rows/s, {r['stored_items_per_s']:,.0f} items/s; "
            f"{r['backlog_at_end_items']:,} items in the spools at the end of the window, drained "
            f"{r['drain_after_window_s']:.1f} s later",
        ),
        (
            "apply of one spool item (connection, statements, commit)",
            f"p50 {apply['p50']:.1f} ms, p99 {apply['p99']:.1f} ms, max {apply['max']:.0f} ms "
            f"({apply['count']:,} items)",
        ),
        ("hand-over to stored", f"p50 {wait['p50']:.0f} ms, p99 {wait['p99']:.0f} ms"),
        (
            "database bytes per node-day",
            f"{r['bytes_per_node_day'] / 2**20:,.1f} MiB ({r['node_days']:.1f} node-days: "
            + ", ".join(
                f"{name} {size / 2**20:,.0f} MiB"
                for name, size in r["table_bytes"].items()
                if size > 2**20
            )
            + ")",
        ),
        (
            "CPU seconds in the window: agents, PostgreSQL, PgBouncer",
            f"{cpu['agents']:.0f} s, {cpu['postgresql']:.0f} s, {cpu['pgbouncer']:.0f} s of "
            f"{r['minutes'] * 60 * (os.cpu_count() or 1):.0f}: PostgreSQL "
            f"{r['postgresql_cpu_ms_per_item']:.1f} ms an item stored",
        ),
        (
            "machine CPU busy over the window",
            f"{r['cpu_busy_percent']:.0f} % of {os.cpu_count()} cores; load "
            f"{r['load_average'][0]:.1f} -> {r['load_average'][1]:.1f}; worst agent "
            f"{r['worst_schedule_lag_s']:.1f} s behind its schedule",
        ),
        (
            "check",
            f"{c['runs']:,} runs ({c['runs_still_running']} still running at the end), "
            f"{c['series']:,} series, {c['events']:,} events, {c['stacks']} stacks, "
            f"{c['rollup_rows']:,} rollup rows; {c['rejected']} rejected, "
            f"{c['write_errors']} write errors, {c['spool_items_left']} left in spools: "
            + ("every id once" if not c["problems"] else "; ".join(c["problems"])),
        ),
    ]
    for name, value in rows:
        print(f"| {name} | {value} |")


# The results run ------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=200, help="writer processes")
    parser.add_argument("--minutes", type=float, default=5.0, help="length of the traffic")
    parser.add_argument("--nodes", type=int, default=FLEET_NODES, help="nodes the agents stand for")
    parser.add_argument("--gpus", type=int, default=GPUS, help="GPUs a node")
    parser.add_argument("--rollups", action="store_true", help="per-minute rollups as well")
    parser.add_argument("--direct", action="store_true", help="no PgBouncer in between")
    parser.add_argument("--pool-size", type=int, default=20, help="PgBouncer server connections")
    parser.add_argument("--results", type=int, help="load this many results and time the reports")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many query runs")
    parser.add_argument(
        "--drift-repeats", type=int, help="for the drift query (default --repeats; 0: not timed)"
    )
    parser.add_argument("--database", help="database name (default: made and dropped)")
    parser.add_argument("--keep", action="store_true", help="keep the database")
    parser.add_argument(
        "--lean",
        action="store_true",
        help="--results without the runs' manifest, result and analysis JSON (no query reads them)",
    )
    parser.add_argument("--reuse", action="store_true", help="time a kept --results database")
    parser.add_argument(
        "--readers", type=int, help="then time this many nodes' hourly reads (--keep or --reuse)"
    )
    args = parser.parse_args()
    if args.readers is not None and not (args.keep or args.reuse):
        parser.error("--readers reads a kept database: give --keep (or --reuse)")
    memory = psutil.virtual_memory().total / 2**30
    machine = (
        f"{cpu_model()}, {os.cpu_count()} cores, {memory:.1f} GiB; PostgreSQL "
        f"{postgres_version()}; Python {platform.python_version()}, SQLAlchemy "
        f"{sqlalchemy.__version__}"
    )
    print(f"machine: {machine}", flush=True)
    try:
        if args.results is not None or args.reuse:
            args.results = args.results or 0
            result = {"mode": "results", "machine": machine, **results_run(args)}
            print_results(result)
            if args.readers is not None:
                url = f"{POSTGRES_SERVER}/{result['database']}"
                result["readers"] = readers_run(url, args.readers, FLEET_NODES)
                print_readers(result["readers"])
        else:
            result = {"mode": "traffic", "machine": machine, **traffic(args)}
            print_traffic(result)
    except PgBouncerError as exc:
        print(
            f"fleet_scale: {exc} (or --direct, for fewer agents than max_connections)",
            file=sys.stderr,
        )
        return 2
    print("RESULT " + json.dumps(result, sort_keys=True))
    if result["mode"] == "traffic" and result["check"]["problems"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
