"""The fleet archive behind PgBouncer in transaction mode (docs/scale.md): a fleet of thousands
of agents cannot hold a server connection each, so they share a few through PgBouncer, where
each transaction may run on a different server connection.

Through a private pgbouncer (transaction pooling, two server connections for four writers, so
that they are shared): the migrations, several agents' ArchiveSinks writing probe runs and events
at once from their own processes, and `sustain db current` / `sustain capacity` from the CLI.
Nothing may be rejected, lost or doubled. Without ``prepare_threshold=None`` (psycopg prepares a
statement after 5 runs, on one server connection) the writers' items fail with "prepared
statement _pg3_0 does not exist" or "already exists" and are set aside as rejected.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pgbouncer_server import INSTALL_HINT, PGBOUNCER, PgBouncer
from sqlalchemy import Connection, Engine, text

from agent.archive.database import current_revision, head_revision, open_engine, upgrade
from agent.archive.sink import ArchiveSink
from agent.archive.spool import Spool
from agent.probes.analysis import RunAnalysis
from agent.probes.attribution import Attribution
from agent.probes.protocol import Iteration
from agent.probes.runner import ProbeDevice, ProbeRun, ProbeSpec
from collectors.base import Event

WRITERS = 4
RUNS = 12  # each statement runs more than psycopg's 5 times before it prepares
EVENTS = 15
SERVER_CONNECTIONS = 2
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bouncer(tmp_path: Path) -> Iterator[PgBouncer]:
    if PGBOUNCER is None:
        pytest.fail(f"pgbouncer is needed for this test: {INSTALL_HINT}", pytrace=False)
    directory = tmp_path / "pgbouncer"
    directory.mkdir()
    with PgBouncer(directory, default_pool_size=SERVER_CONNECTIONS) as running:
        yield running


@pytest.fixture
def pooled_url(postgres_url: str, bouncer: PgBouncer) -> str:
    """The test database's URL through the pooler."""
    return bouncer.url(postgres_url.rsplit("/", 1)[1])


@dataclass(frozen=True, slots=True)
class Handed:
    """What one agent handed over, and its sink's state after stopping."""

    runs: list[str]
    events: list[str]
    empty: bool
    spool_items: int
    rejected: int
    write_errors: int


def write_as_agent(url: str, node: str, spool_path: str) -> Handed:
    """One agent's archive path: spool, drain thread, stop; what it handed over and its status."""
    engine = open_engine(url)
    sink = ArchiveSink(engine, node, Spool(Path(spool_path)))
    sink.start_draining()
    run_ids, event_ids = [], []
    for index in range(RUNS):
        device = ProbeDevice("cuda", f"GPU-{node}-{index % 8}", f"gpu{index % 8}", index % 8)
        spec = ProbeSpec("matmul", "bf16", "eager", 20.0, device, "default")
        started = 1_780_000_000.0 + index * 60
        iterations = tuple(
            Iteration(i, started + i * 0.02, started + (i + 1) * 0.02, 1.1e13, "measure")
            for i in range(100)
        )
        manifest = {"unit": "FLOP/s", "work_unit": "flop", "device_name": "NVIDIA H100 80GB HBM3"}
        run = ProbeRun(uuid.uuid4().hex, spec, "ok", "", started, started + 2.0, manifest,
                       {"throughput": 5.5e14}, iterations, 0, "")  # fmt: skip
        figures = {"classification": "flat", "steady_throughput": 5.5e14 + index}
        analysis = RunAnalysis(figures, Attribution((), None, None, "no telemetry"))
        sink.start(run.id, spec, started)
        sink.finish(run, analysis=analysis)
        run_ids.append(run.id)
    for index in range(EVENTS):
        event = Event("throttle_episode", f"GPU-{node}-0", 1_780_000_000.0 + index, "sw_power_cap")
        sink.add_events([event])
        event_ids.append(event.id)
    empty = sink.stop(60)
    status = sink.status()
    sink.spool.close()
    engine.dispose()
    return Handed(run_ids, event_ids, empty, status.spool_items, status.rejected,
                  status.write_errors)  # fmt: skip


def counted(connection: Connection, query: str) -> dict[str, int]:
    return {str(key): int(count) for key, count in connection.execute(text(query))}


def sustain(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI as an operator runs it, with the archive URL in its environment; it must succeed."""
    environment = {**os.environ, "SUSTAIN_ARCHIVE__DATABASE_URL": url}
    command = [sys.executable, "-m", "agent", *args]
    done = subprocess.run(
        command, env=environment, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done


def test_migrations_run_through_transaction_pooling(pooled_url: str) -> None:
    engine = open_engine(pooled_url)
    try:
        upgrade(engine)
        upgrade(engine)  # a second agent starting: nothing to do
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()


@pytest.mark.slow
def test_agents_write_through_transaction_pooling(
    pooled_url: str, postgres_url: str, tmp_path: Path
) -> None:
    migrator = open_engine(pooled_url)
    upgrade(migrator)
    migrator.dispose()
    context = multiprocessing.get_context("spawn")
    with context.Pool(WRITERS) as pool:
        handed = pool.starmap(
            write_as_agent,
            [(pooled_url, f"node-{i}", str(tmp_path / f"spool-{i}.db")) for i in range(WRITERS)],
        )
    for agent in handed:
        assert (agent.empty, agent.spool_items, agent.rejected, agent.write_errors) == (
            True,
            0,
            0,
            0,
        )
    direct: Engine = open_engine(postgres_url)  # counted on the server itself, not the pooler
    try:
        with direct.connect() as connection:
            runs = counted(connection, "SELECT run_id, COUNT(*) FROM probe_runs GROUP BY 1")
            events = counted(connection, "SELECT event_id, COUNT(*) FROM events GROUP BY 1")
            series = connection.execute(text("SELECT COUNT(*) FROM probe_series")).scalar_one()
    finally:
        direct.dispose()
    expected_runs = {run for agent in handed for run in agent.runs}
    expected_events = {event for agent in handed for event in agent.events}
    assert len(expected_runs) == WRITERS * RUNS
    assert runs == dict.fromkeys(expected_runs, 1)
    assert events == dict.fromkeys(expected_events, 1)
    assert series == WRITERS * RUNS

    current = sustain(pooled_url, "db", "current")
    assert current.stdout.strip() == head_revision()
    capacity = sustain(pooled_url, "capacity", "--by", "model", "--json")
    rows = json.loads(capacity.stdout)["rows"]
    assert [(row["group"], row["results"]) for row in rows] == [
        ("NVIDIA H100 80GB HBM3", WRITERS * RUNS)
    ]
