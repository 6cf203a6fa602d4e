"""The durable spool in front of the archive: order, idempotent replay, refusals set aside, and
(acceptance 3 of the fleet archive) a private PostgreSQL stopped and started again under a running
agent without a result lost or doubled."""

from __future__ import annotations

import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conftest import PrivatePostgres, fetch, free_port
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, create_engine, text
from test_bounded_runs import iteration_capped_python

from agent.archive.database import open_engine, upgrade
from agent.archive.sink import ArchiveSink
from agent.archive.spool import Spool
from agent.probes.runner import CPU, ProbeRun, ProbeSpec
from agent.telemetry.rollup import RollupRow
from collectors.base import Event

SPEC = ProbeSpec("matmul", "fp32", "eager", 2.0, CPU, None)


def rollup(period_start: float) -> RollupRow:
    return RollupRow("host", "host", "cpu_utilization_ratio", "", "gauge", period_start, 10,
                     0.5, 0.1, 0.9, 0.8, 10)  # fmt: skip


def run(run_id: str) -> ProbeRun:
    return ProbeRun(run_id, SPEC, "ok", "", 1000.0, 1002.0)


def test_items_come_back_in_order_and_survive_reopening(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    for index in range(5):
        spool.append("events", {"n": index}, records=2)
    spool.close()
    spool = Spool(tmp_path / "spool.db")  # a restart: the file is all there is
    items = spool.head(10)
    assert [item.payload["n"] for item in items] == [0, 1, 2, 3, 4]
    spool.remove(items[0].seq)
    stats = spool.stats()
    assert (stats.items, stats.records_by_kind) == (4, {"events": 8})
    assert stats.oldest_created is not None
    assert stats.bytes > 0


def test_drain_applies_in_order_and_a_replay_stores_nothing_twice(
    archive_engine: Engine, tmp_path: Path
) -> None:
    sink = ArchiveSink(archive_engine, "node-a", Spool(tmp_path / "spool.db"))
    run_id = uuid.uuid4().hex
    sink.start(run_id, SPEC, 1000.0)
    sink.finish(run(run_id), stack_id="ab" * 32)
    sink.add_rollups([rollup(600.0), rollup(610.0)])
    sink.add_events([Event("xid", "GPU-0", 1001.0, "XID 79")])
    sink.add_stack("ab" * 32, {"driver": {"version": "550.54.15"}}, 1000.0)
    payloads = [(item.kind, item.payload) for item in sink.spool.head(100)]
    assert [kind for kind, _ in payloads] == [
        "probe_start", "probe_finish", "rollups", "events", "stack"
    ]  # fmt: skip
    assert sink.drain()
    # The same writes again, as after a crash between the commit and the spool's delete.
    for kind, payload in payloads:
        sink.spool.append(kind, payload)
    assert sink.drain()
    with archive_engine.connect() as connection:
        counts = {
            table: connection.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar_one()
            for table in ("probe_runs", "telemetry_rollups", "events", "stack_snapshots")
        }
        outcome, stack_id = connection.execute(
            text("SELECT outcome, stack_id FROM probe_runs")
        ).one()
    assert counts == {"probe_runs": 1, "telemetry_rollups": 2, "events": 1, "stack_snapshots": 1}
    assert (outcome, stack_id) == ("ok", "ab" * 32)  # the start replayed after the end: no harm
    status = sink.status()
    assert (status.spool_items, status.rows_written, status.events_written) == (0, 4, 2)


def test_a_write_the_database_refuses_for_good_is_set_aside(
    archive_engine: Engine, tmp_path: Path
) -> None:
    sink = ArchiveSink(archive_engine, "node-a", Spool(tmp_path / "spool.db"))
    sink.add_rollups([replace(rollup(600.0), kind="bogus")])  # type: ignore[arg-type]  # breaks a CHECK constraint
    sink.add_events([Event("xid", "GPU-0", 1001.0, "XID 79")])
    assert sink.drain()  # not stuck behind the refused batch
    assert sink.status().rejected == 1
    with archive_engine.connect() as connection:
        assert connection.execute(text("SELECT COUNT(*) FROM events")).scalar_one() == 1
    spool = sqlite_rows(tmp_path / "spool.db", "SELECT kind, error FROM rejected")
    assert [kind for kind, _ in spool] == ["rollups"]
    assert "ck_telemetry_rollups_kind" in spool[0][1]


def sqlite_rows(path: Path, query: str) -> list[tuple[str, str]]:

    with sqlite3.connect(path) as connection:
        return list(connection.execute(query).fetchall())


# Acceptance 3: a private PostgreSQL instance, stopped and started under a running agent.


def probe_runs_total(body: str) -> int:
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(body)
            if family.name == "sustain_probe_runs"
            for sample in family.samples
        )
    )


def gauge(body: str, name: str) -> float | None:
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return None


def rolled_up(url: str) -> bool:
    """A whole rollup period of the agent's is in the database."""
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return bool(
                connection.execute(
                    text(
                        "SELECT COUNT(*) FROM telemetry_rollups WHERE node = 'outage-node' "
                        "AND field = 'cpu_utilization_ratio'"
                    )
                ).scalar_one()
            )
    finally:
        engine.dispose()


@pytest.mark.slow  # end-to-end: agents, outages, faults (left out of the quick tier)
def test_database_outage_loses_and_doubles_nothing(
    private_postgres: PrivatePostgres, tmp_path: Path
) -> None:
    engine = open_engine(private_postgres.url)
    upgrade(engine)
    engine.dispose()
    config = tmp_path / "sustain.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [agent]
            node = "outage-node"
            [archive]
            database_url = "{private_postgres.url}"
            rollup_seconds = 10
            # The fleet database gets the rollups too (the default keeps them on the node), so
            # that they cross the outage through the spool.
            fleet_rollup_seconds = 10
            [probing]
            initial_delay_seconds = 0
            duty_cycle = 1.0
            busy_cpu_utilization = 1.0
            preempt = false  # the suite's other processes are foreign work too
            # 40 iterations, however long a loaded machine makes them (the duration only bounds
            # them): a run short of the analysis minimum would be a timeout, not this test's case.
            python = "{iteration_capped_python(tmp_path, 40)}"
            [[probing.plan]]
            workload = "matmul"
            precisions = ["fp32"]
            duration_seconds = 30
            size = "small"
            interval_seconds = 4
            jitter_seconds = 0
            [drift]
            enabled = false
            """
        )
    )
    port = free_port()
    log = (tmp_path / "agent.log").open("w")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUSTAIN_", "FAKENVML_"))}
    agent = subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--config", str(config),
         "--listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=log, env=env,
    )  # fmt: skip
    metrics = f"http://127.0.0.1:{port}/metrics"

    def scrape() -> str:
        return fetch(metrics, timeout=5)[1]

    def wait(condition: str, check: object, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert agent.poll() is None, (tmp_path / "agent.log").read_text()
            try:
                body = scrape()
            except OSError:
                time.sleep(0.5)
                continue
            if check(body):  # type: ignore[operator]
                return body
            time.sleep(0.5)
        pytest.fail(f"{condition} not seen in {timeout} s:\n{(tmp_path / 'agent.log').read_text()}")

    try:
        wait("two probe runs", lambda body: probe_runs_total(body) >= 2, 240)
        # The first rollup period is partial and dropped by design: let one whole period close
        # and reach the database before the outage, so the period the outage began in is one
        # the agent rolls up.
        deadline = time.monotonic() + 240
        while not rolled_up(private_postgres.url):
            assert agent.poll() is None, (tmp_path / "agent.log").read_text()
            assert time.monotonic() < deadline, "no rollup period in the database in 240 s"
            time.sleep(0.5)
        private_postgres.stop()
        outage_began = datetime.now(UTC)
        down = time.monotonic()
        body = wait(
            "a spool backlog",
            lambda body: (gauge(body, "sustain_archive_spool_items") or 0) >= 3,
            90,
        )
        during = probe_runs_total(body)
        # Results and rollups pile up: the outage lasts 25 s at least, and until the agent has
        # gone on probing (two more runs, four in all) and has counted its failed writes.
        body = wait(
            "probe runs and write errors during the outage",
            lambda body: (
                time.monotonic() - down >= 25
                and probe_runs_total(body) >= max(during + 2, 4)
                and (gauge(body, "sustain_archive_write_errors_total") or 0) >= 1
            ),
            240,
        )
        assert probe_runs_total(body) > during  # the agent went on probing
        assert (gauge(body, "sustain_archive_write_errors_total") or 0) >= 1
        private_postgres.start()
        outage_ended = datetime.now(UTC)
        wait("an empty spool", lambda body: gauge(body, "sustain_archive_spool_items") == 0, 240)
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=60) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
        log.close()
    # Every run the agent finished logged one line; each must be in the database once.
    logged = [
        line
        for line in (tmp_path / "agent.log").read_text().splitlines()
        if " ok: " in line and "probe matmul" in line and "iterations" in line
    ]
    produced = len(logged)
    assert produced >= probe_runs_total(body) >= 4
    checker = create_engine(private_postgres.url)
    try:
        with checker.connect() as connection:
            rows = connection.execute(
                text("SELECT run_id, outcome FROM probe_runs WHERE node = 'outage-node'")
            ).all()
            periods = (
                connection.execute(
                    text(
                        "SELECT period_start FROM telemetry_rollups WHERE field = "
                        "'cpu_utilization_ratio' AND node = 'outage-node' ORDER BY period_start"
                    )
                )
                .scalars()
                .all()
            )
            series = connection.execute(text("SELECT run_id FROM probe_series")).scalars().all()
    finally:
        checker.dispose()
    run_ids = [row[0] for row in rows]
    assert len(run_ids) == len(set(run_ids))
    finished = [row for row in rows if row[1] not in ("running", "aborted")]
    assert len(finished) == produced
    assert all(outcome == "ok" for _, outcome in finished)
    # Every finished run's series once; a run the SIGTERM aborted keeps the iterations it had.
    assert len(series) == len(set(series))
    assert {row[0] for row in finished} <= set(series) <= set(run_ids)
    assert not [row for row in rows if row[1] == "running"]
    # Every rollup period from the first to the last, the outage included: no gap.
    steps = {(b - a).total_seconds() for a, b in itertools.pairwise(periods)}
    assert steps == {10.0}, periods
    # ... and they cover the outage: the period it began in and the last whole one before its end
    # (how long the agent ran before it is the machine's business, not this test's).
    period = timedelta(seconds=10)
    assert periods[0] <= outage_began.replace(second=outage_began.second // 10 * 10, microsecond=0)
    assert (
        periods[-1]
        >= outage_ended.replace(second=outage_ended.second // 10 * 10, microsecond=0) - period
    )
