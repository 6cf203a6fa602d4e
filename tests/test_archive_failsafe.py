"""Issue 26, the archive side: nothing in the spool or the database stops the agent or its archive
writer, and what cannot be kept is counted. A spool locked by another process, malformed or corrupt,
or full; a PostgreSQL session that went read-only; and (acceptance 3) an agent started while its
PostgreSQL is down, which serves /metrics at once and writes its rollups once the server starts."""

from __future__ import annotations

import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import PrivatePostgres, fetch, free_port, start_agent
from prometheus_client import CollectorRegistry
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.exc import OperationalError

from agent.archive import database, fleet_baselines, summary
from agent.archive import sink as sink_module
from agent.archive.database import current_revision, head_revision, open_engine, upgrade
from agent.archive.sink import ArchiveSink
from agent.archive.spool import Spool
from agent.exporter.server import ExporterApp
from collectors.base import Event

DEADLINE = 60.0


def wait_for(condition: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not seen in {timeout} s"
        time.sleep(0.1)


@pytest.fixture
def sqlite_archive(tmp_path: Path) -> Engine:
    engine = open_engine(f"sqlite:///{tmp_path / 'archive.db'}")
    upgrade(engine)
    return engine


def events_in(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(connection.execute(text("SELECT COUNT(*) FROM events")).scalar_one())


def event(n: int) -> Event:
    return Event("xid", "GPU-0", 1_780_000_000.0 + n, f"XID {n}")


def test_a_spool_locked_by_another_process_holds_up_neither_producers_nor_the_writer(
    sqlite_archive: Engine, tmp_path: Path
) -> None:
    sink = ArchiveSink(sqlite_archive, "node-a", Spool(tmp_path / "spool.db"))
    sink.start_draining()
    locker = sqlite3.connect(tmp_path / "spool.db", isolation_level=None)
    try:
        locker.execute("BEGIN EXCLUSIVE")
        for n in range(20):  # none waits for the lock: each is held in memory
            sink.add_events([event(n)])
        # Nor does the writer: it meets the lock and applies the held writes straight to the
        # database, all of them while the spool is still locked. (A count of what is held at
        # one moment would race the writer; where they end up, and when, does not.)
        wait_for(lambda: events_in(sqlite_archive) == 20, "the 20 events past the locked spool")
        assert sink.status().spool_errors >= 1
        assert sink.writer_running
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    status = sink.status()
    assert sink.writer_running
    assert (status.spool_items, status.memory_items, status.lost) == (0, 0, {})
    assert sink.stop(5.0)
    sink.spool.close()


def test_a_malformed_spool_row_is_set_aside_and_counted(
    sqlite_archive: Engine, tmp_path: Path
) -> None:
    path = tmp_path / "spool.db"
    Spool(path).close()
    with sqlite3.connect(path) as connection:
        connection.execute(
            "INSERT INTO spool (kind, payload, records, created) "
            "VALUES ('events', '{not json', 1, 0)"
        )
    sink = ArchiveSink(sqlite_archive, "node-a", Spool(path))
    sink.add_events([event(1)])
    assert sink.drain()
    assert events_in(sqlite_archive) == 1
    assert sink.status().rejected == 1
    with sqlite3.connect(path) as connection:
        rejected = (
            connection.execute("SELECT payload, error FROM rejected").all()
            if False
            else (connection.execute("SELECT payload, error FROM rejected").fetchall())
        )
    assert [payload for payload, _ in rejected] == ["{not json"]
    assert "malformed" in rejected[0][1]
    sink.spool.close()


def test_a_corrupt_spool_is_moved_aside_and_a_fresh_one_made(tmp_path: Path) -> None:
    path = tmp_path / "spool.db"
    path.write_bytes(b"this is no SQLite file, " * 100)
    spool = Spool(path)
    spool.append("events", {"n": 1})
    assert [item.payload for item in spool.head(10)] == [{"n": 1}]
    aside = [p.name for p in tmp_path.iterdir() if p.name.startswith("spool.db.corrupt-")]
    assert len(aside) == 1
    assert (tmp_path / aside[0]).read_bytes().startswith(b"this is no SQLite file")
    spool.close()


def fill(spool: Spool) -> None:
    """The spool's disk takes no more writes (reads still work, as on a full disk)."""
    db = spool._db
    assert db is not None
    db.execute("PRAGMA query_only = ON")
    with pytest.raises(sqlite3.OperationalError):
        db.execute("INSERT INTO spool (kind, payload, records, created) VALUES ('x', 'x', 1, 0)")


def test_a_full_spool_holds_writes_in_memory_and_writes_them_straight_to_the_database(
    sqlite_archive: Engine, tmp_path: Path
) -> None:
    sink = ArchiveSink(sqlite_archive, "node-a", Spool(tmp_path / "spool.db"))
    fill(sink.spool)
    sink.add_events([event(n) for n in range(50)])
    assert sink.drain()
    assert events_in(sqlite_archive) == 50
    status = sink.status()
    assert status.spool_errors >= 1
    assert (status.memory_items, status.lost) == (0, {})
    sink.spool.close()


def test_writes_dropped_while_neither_spool_nor_database_takes_them_are_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sink_module, "MEMORY_ITEMS", 3)
    unreachable = create_engine("postgresql+psycopg://sustain@127.0.0.1:1/x")
    sink = ArchiveSink(unreachable, "node-a", Spool(tmp_path / "spool.db"))
    fill(sink.spool)
    for n in range(5):
        sink.add_events([event(2 * n), event(2 * n + 1)])
    assert not sink.drain()
    status = sink.status()
    assert status.memory_items == 3
    assert status.lost == {"events": 4}
    assert status.write_errors >= 1
    sink.spool.close()


def test_healthz_says_when_the_archive_writer_has_stopped() -> None:
    alive = [True]
    app = ExporterApp(CollectorRegistry(), list, archive_writer=lambda: alive[0])
    statuses: list[str] = []

    def get() -> bytes:
        environ = {"PATH_INFO": "/healthz", "REQUEST_METHOD": "GET"}
        return b"".join(app(environ, lambda status, headers: statuses.append(status)))

    assert get() == b"ok\n"
    alive[0] = False
    assert get() == b"stalled: archive writer\n"
    assert statuses == ["200 OK", "503 Service Unavailable"]


def test_the_writer_thread_survives_any_error(
    sqlite_archive: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = ArchiveSink(sqlite_archive, "node-a", Spool(tmp_path / "spool.db"))
    calls = [0]
    head = sink.spool.head

    def failing_head(limit: int) -> list:  # type: ignore[type-arg]
        calls[0] += 1
        if calls[0] == 1:
            raise sqlite3.OperationalError("database is locked")
        return head(limit)

    monkeypatch.setattr(sink.spool, "head", failing_head)
    sink.add_events([event(1)])
    sink.start_draining()
    wait_for(lambda: events_in(sqlite_archive) == 1, "the event after the error")
    assert sink.writer_running
    assert sink.stop(5.0)
    sink.spool.close()


def test_migrations_and_the_fleet_pass_are_not_bound_by_the_agents_statement_timeout(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A migration over a fleet's archive and the fleet baselines' pass take minutes at 10
    million runs: the agent's statement timeout (shortened here to 1 s, a statement made to
    take 1.5 s) cancels its own statements, not theirs."""
    engine = open_engine(postgres_url)
    upgrade(engine, "0012")
    engine.dispose()
    monkeypatch.setattr(database, "STATEMENT_TIMEOUT", "1s")
    engine = open_engine(postgres_url)
    slow = text("SELECT pg_sleep(1.5)")
    with pytest.raises(OperationalError, match="statement timeout"), engine.begin() as connection:
        connection.execute(slow)
    create_by_day = summary.create_by_day

    def slow_migration(connection: Connection) -> None:
        connection.execute(slow)
        create_by_day(connection)

    monkeypatch.setattr(summary, "create_by_day", slow_migration)  # migration 0013's work
    upgrade(engine)
    assert current_revision(engine) == head_revision()
    with engine.begin() as connection:
        now = datetime.now(UTC)
        fleet_baselines.refresh(connection, cutoff=now, since=now - timedelta(days=7))
        connection.execute(slow)
        timeout = connection.execute(text("SHOW statement_timeout")).scalar_one()
    assert timeout == fleet_baselines.STATEMENT_BOUND
    with engine.connect() as connection:  # and the agent's sessions keep theirs
        assert connection.execute(text("SHOW statement_timeout")).scalar_one() == "1s"
    engine.dispose()


def test_postgresql_sessions_time_out_on_locks_and_a_read_only_one_is_replaced(
    postgres_url: str, tmp_path: Path
) -> None:
    engine = open_engine(postgres_url)
    upgrade(engine)
    with engine.connect() as connection:
        lock = connection.execute(text("SHOW lock_timeout")).scalar_one()
        statement = connection.execute(text("SHOW statement_timeout")).scalar_one()
    assert (lock, statement) == ("10s", "1min")
    assert engine.pool._recycle == 300
    # The pooled session went read-only (as after ALTER DATABASE ... SET
    # default_transaction_read_only, which sticks to sessions made before its reset).
    with engine.connect() as connection:
        connection.execute(text("SET SESSION default_transaction_read_only = on"))
        connection.commit()
    sink = ArchiveSink(engine, "node-a", Spool(tmp_path / "spool.db"))
    sink.add_events([event(1)])
    sink.drain()  # may meet the read-only session once
    assert sink.drain()  # then a fresh one
    assert events_in(engine) == 1
    assert sink.status().rejected == 0
    sink.spool.close()
    engine.dispose()


def test_stop_keeps_its_deadline_while_a_lock_holds_the_write(
    postgres_url: str, tmp_path: Path
) -> None:
    engine = open_engine(postgres_url)
    upgrade(engine)
    sink = ArchiveSink(engine, "node-a", Spool(tmp_path / "spool.db"))
    sink.start_draining()
    blocker = create_engine(postgres_url)
    with blocker.connect() as connection:
        connection.execute(text("LOCK TABLE events IN ACCESS EXCLUSIVE MODE"))
        sink.add_events([event(1)])
        time.sleep(1)  # the writer is waiting on the lock
        done = threading.Event()
        result: list[bool] = []

        def stop() -> None:
            result.append(sink.stop(3.0))
            done.set()

        threading.Thread(target=stop, daemon=True).start()
        # Generous: lock_timeout (10 s) would end it too; the point is that it ends while the
        # lock is still held, with the write left in the spool.
        assert done.wait(9.0), "stop waited on the lock"
        connection.rollback()
    assert result == [False]
    assert sink.status().spool_items == 1
    sink.spool.close()
    engine.dispose()
    blocker.dispose()


def gauge(body: str, name: str) -> float | None:
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.slow
def test_an_agent_started_while_postgresql_is_down_serves_and_archives_once_it_is_up(
    private_postgres: PrivatePostgres, tmp_path: Path
) -> None:
    private_postgres.stop()
    config = tmp_path / "sustain.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [agent]
            node = "late-node"
            [archive]
            database_url = "{private_postgres.url}"
            rollup_seconds = 2
            fleet_rollup_seconds = 2
            [probing]
            enabled = false
            [nvml]
            enabled = false
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

    def scrape() -> str | None:
        assert agent.poll() is None, (tmp_path / "agent.log").read_text()
        try:
            return fetch(f"http://127.0.0.1:{port}/metrics", timeout=5)[1]
        except OSError:
            return None

    try:
        body: list[str] = []

        def serving_down() -> bool:
            text_ = scrape()
            body[:] = [text_ or ""]
            return text_ is not None and gauge(text_, "sustain_archive_up") == 0

        wait_for(serving_down, "/metrics with sustain_archive_up 0", 30)
        wait_for(
            lambda: (gauge(scrape() or "", "sustain_archive_spool_items") or 0) >= 2,
            "rollups waiting in the spool",
            120,
        )
        assert fetch(f"http://127.0.0.1:{port}/healthz", timeout=5)[0] == 200
        private_postgres.start()
        wait_for(
            lambda: gauge(scrape() or "", "sustain_archive_up") == 1,
            "the archive opened",
            150,
        )
        wait_for(
            lambda: gauge(scrape() or "", "sustain_archive_spool_items") == 0,
            "an empty spool",
            120,
        )
        # Two periods at least, to check that none is missing between them: the spool's two
        # items may have been one period and an event (seen on a loaded machine).
        wait_for(
            lambda: len(_cpu_periods(_late_rollups(private_postgres.url))) >= 2,
            "two periods of rollups in the database",
            120,
        )
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=60) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
        log.close()
    rows = _late_rollups(private_postgres.url)
    assert rows
    assert len(rows) == len(set(rows))  # none doubled
    periods = _cpu_periods(rows)
    assert len(periods) >= 2
    steps = {(b - a).total_seconds() for a, b in itertools.pairwise(periods)}
    assert steps == {2.0}, periods  # none missing between the first and the last


def _late_rollups(url: str) -> list[Any]:
    checker = create_engine(url)
    try:
        with checker.connect() as connection:
            return list(
                connection.execute(
                    text(
                        "SELECT device, field, labels, period_start FROM telemetry_rollups "
                        "WHERE node = 'late-node'"
                    )
                ).all()
            )
    finally:
        checker.dispose()


def _cpu_periods(rows: list[Any]) -> list[Any]:
    return sorted({row[3] for row in rows if row[1] == "cpu_utilization_ratio"})


@pytest.mark.slow
def test_an_agent_started_on_a_corrupt_spool_sets_it_aside_and_archives(tmp_path: Path) -> None:
    """Item 3 at the daemon: a spool file that is no SQLite database (a torn disk write, a
    stray copy) is moved aside with one log line; the agent serves and archives into a fresh
    spool, where it exited 2 before."""
    (tmp_path / "spool.db").write_bytes(b"not a database, " * 256)
    agent = start_agent(tmp_path, "--config", str(_quiet_config(tmp_path)))
    agent.wait_for("sustain_archive_up 1.0", timeout=60)
    body = agent.wait_for("sustain_archive_last_write_timestamp_seconds ", timeout=60)
    code, _, err = agent.terminate()
    assert code == 0, err
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("spool.db.corrupt-")]
    assert len(aside) == 1, sorted(p.name for p in tmp_path.iterdir())
    assert aside[0].read_bytes().startswith(b"not a database")
    assert sum(line.count(aside[0].name) for line in err.splitlines()) == 1, err
    assert "Traceback" not in err
    assert "sustain_archive_up 1.0" in body


def _quiet_config(directory: Path) -> Path:
    config = directory / "sustain.toml"
    config.write_text(
        "[archive]\nrollup_seconds = 1\n[probing]\nenabled = false\n[nvml]\nenabled = false\n"
        "[drift]\nenabled = false\n"
    )
    return config
