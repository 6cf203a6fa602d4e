"""bench/fleet_scale.py --readers N: what every node reads from the fleet database each hour.

Over a kept --results database (``--database NAME --reuse``, or loaded in the same run), at
the results' latest time:

- the fleet's pass (agent.archive.fleet_baselines.refresh, committed): once a period for the
  whole fleet, by whichever agent takes its lock;
- then N nodes spread over the fleet, each doing what its agent does in an hour on PostgreSQL:
  its drift child's reads (its own history, ``load_history(node=...)``; its stacks' facts; its
  fleet outliers by key, ``outliers_by_key``) and one health baseline lookup
  (``records.baseline``) per probe its devices run (the default plan probes each once an hour).

For each: wall seconds, the CPU seconds of the PostgreSQL backend that served it (its process,
read with psutil: the bench shares the machine with the server), and the rows the server read
for it (sequential scan rows plus index entries, pg_stat_user_tables and pg_stat_user_indexes,
the backend's statistics flushed with pg_stat_force_next_flush, PostgreSQL 15 and later). Then
the per node-hour figures, and the database's CPU an hour for ``FLEET_NODES`` nodes: each node's
hour, plus the one pass.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psutil
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import StaticPool

from agent.archive import fleet_baselines

ROWS_READ = text(
    "SELECT (SELECT coalesce(sum(seq_tup_read), 0) FROM pg_stat_user_tables) "
    "+ (SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes)"
)


class Served:
    """One PostgreSQL backend (a single-connection engine) and what serving costs it."""

    def __init__(self, url: str) -> None:
        self.engine = create_engine(url, poolclass=StaticPool)
        self._watch = create_engine(url, poolclass=StaticPool)
        with self.engine.connect() as connection:
            self.pid = connection.execute(text("SELECT pg_backend_pid()")).scalar_one()

    def _rows(self) -> int:
        with self._watch.connect() as connection:
            connection.execute(text("SELECT pg_stat_clear_snapshot()"))
            return int(connection.execute(ROWS_READ).scalar_one())

    def measure(self, work: Callable[[Engine], Any]) -> tuple[dict[str, float], Any]:
        process = psutil.Process(self.pid)
        rows_before = self._rows()
        cpu = process.cpu_times()
        started = time.perf_counter()
        answer = work(self.engine)
        seconds = time.perf_counter() - started
        with self.engine.connect() as connection:  # the backend's counts, flushed when idle
            connection.execute(text("SELECT pg_stat_force_next_flush()"))
        time.sleep(0.2)
        after = process.cpu_times()
        figures = {
            "seconds": seconds,
            "cpu_s": (after.user + after.system) - (cpu.user + cpu.system),
            "rows": float(self._rows() - rows_before),
        }
        return figures, answer

    def close(self) -> None:
        self.engine.dispose()
        self._watch.dispose()


def _node_hour(engine: Engine, *, node: str, at: Any) -> dict[str, int]:
    """What one node's agent reads in an hour: its drift child, and a baseline lookup a probe."""
    from agent.drift.detect import load_history, outliers_by_key, stack_facts  # noqa: PLC0415
    from agent.health import records  # noqa: PLC0415

    own = load_history(engine, node=node, history=500)
    stack_facts(engine, (r.stack_id for results in own.values() for r in results))
    outliers = outliers_by_key(engine, own, 0.10)
    lookups = 0
    for (_, device, workload, precision, optimization), results in own.items():
        last = results[-1]
        if last.device_model is None or last.stack_id is None:
            continue
        identity = records.ProbeIdentity(
            workload, precision, optimization, "default", last.device_model, last.stack_id
        )
        records.baseline(engine, identity, node, device, (at - timedelta(days=7)).timestamp())
        lookups += 1
    return {
        "series": len(own),
        "results": sum(len(r) for r in own.values()),
        "outliers": sum(o.outlier for o in outliers),
        "lookups": lookups,
    }


def readers_run(url: str, nodes: int, fleet_nodes: int) -> dict[str, Any]:
    served = Served(url)
    try:
        with served.engine.connect() as connection:
            at = connection.execute(text("SELECT max(ended_at) FROM probe_runs")).scalar_one()

        def fleet_pass(engine: Engine) -> int:
            with engine.begin() as connection:
                return fleet_baselines.refresh(connection, cutoff=at, since=at - timedelta(days=7))

        pass_figures, groups = served.measure(fleet_pass)
        per_node = []
        for index in range(nodes):
            name = f"fleet-node-{index * fleet_nodes // nodes:05d}"
            figures, read = served.measure(functools.partial(_node_hour, node=name, at=at))
            per_node.append(figures | read)
    finally:
        served.close()

    def median(key: str) -> float:
        return statistics.median(float(n[key]) for n in per_node)

    node_cpu = median("cpu_s")
    return {
        "at": at.isoformat(),
        "pass": pass_figures | {"groups": groups},
        "nodes": per_node,
        "node_hour": {
            key: median(key) for key in ("seconds", "cpu_s", "rows", "series", "results", "lookups")
        },
        "fleet_nodes": fleet_nodes,
        "fleet_cpu_s_per_hour": node_cpu * fleet_nodes + pass_figures["cpu_s"],
    }


def print_readers(r: dict[str, Any]) -> None:
    p, h = r["pass"], r["node_hour"]
    print(f"\nWhat the nodes read, at the results' latest time ({r['at']})\n")
    print("| reader | wall | database CPU | rows read |")
    print("|---|---|---|---|")
    print(
        f"| the fleet's pass, once a period ({p['groups']} groups) | {p['seconds']:.1f} s | "
        f"{p['cpu_s']:.1f} s | {p['rows']:,.0f} |"
    )
    print(
        f"| one node's hour, median of {len(r['nodes'])} ({h['series']:.0f} series, "
        f"{h['results']:.0f} own results, {h['lookups']:.0f} baseline lookups) | "
        f"{h['seconds']:.3f} s | {h['cpu_s']:.3f} s | {h['rows']:,.0f} |"
    )
    print(
        f"\nThe database's CPU an hour for {r['fleet_nodes']:,} nodes (each node's hour, and "
        f"one pass): {r['fleet_cpu_s_per_hour']:,.0f} s"
    )
