"""The archive against real databases: a SQLite file and PostgreSQL (see conftest.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, func, insert, inspect, select, text
from sqlalchemy.orm import Session
from test_capacity import probe_run

from agent.archive.database import (
    MIGRATIONS,
    ArchiveError,
    current_revision,
    head_revision,
    open_engine,
    upgrade,
)
from agent.archive.models import Base, ProbeRunRecord, TelemetryRollup
from agent.archive.partitions import include_name
from agent.archive.rollups import RollupWriter
from agent.telemetry.rollup import RollupRow

REPO_ROOT = Path(__file__).resolve().parent.parent
T0 = 1_700_000_040.0  # a whole minute


def rollup(
    period_start: float = T0, device: str = "0", field: str = "power_watts", **changes: object
) -> RollupRow:
    row = RollupRow(
        collector="nvml",
        device=device,
        field=field,
        labels="",
        kind="gauge",
        period_start=period_start,
        period_seconds=60,
        mean=250.5,
        min=100.25,
        max=300.0,
        p95=299.5,
        sample_count=60,
    )
    return dataclasses.replace(row, **changes)  # type: ignore[arg-type]


def stored(engine: Engine) -> list[TelemetryRollup]:
    with Session(engine) as session:
        query = select(TelemetryRollup).order_by(TelemetryRollup.id)
        return list(session.scalars(query))


def count(engine: Engine) -> int:
    with engine.connect() as connection:
        return connection.execute(select(func.count()).select_from(TelemetryRollup)).scalar_one()


# Schema and migrations


def test_upgrade_creates_the_schema_at_head(database_url: str) -> None:
    engine = open_engine(database_url)
    try:
        assert current_revision(engine) is None
        upgrade(engine)
        assert current_revision(engine) == head_revision() == "0014"
        tables = set(inspect(engine).get_table_names())
        assert {"telemetry_rollups", "events", "alembic_version"} <= tables
    finally:
        engine.dispose()


def test_upgrading_again_changes_nothing(archive_engine: Engine) -> None:
    RollupWriter(archive_engine, "node-a").write([rollup()])
    upgrade(archive_engine)
    assert current_revision(archive_engine) == head_revision()
    assert count(archive_engine) == 1


def test_concurrent_upgrades_take_turns(database_url: str) -> None:
    # Agents of a fleet start together against one database; all must come up. Separate
    # processes, as in a fleet (and Alembic's command API is not thread-safe).
    start_at = time.time() + 2  # after every agent has imported and connected
    script = (
        "import sys, time\n"
        "from agent.archive.database import open_engine, upgrade\n"
        "engine = open_engine(sys.argv[1])\n"
        "time.sleep(max(0.0, float(sys.argv[2]) - time.time()))\n"
        "upgrade(engine)\n"
    )
    agents = [
        subprocess.Popen(
            [sys.executable, "-c", script, database_url, str(start_at)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [agent.communicate(timeout=120)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0] * len(agents), outputs
    engine = open_engine(database_url)
    try:
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()


def test_migrations_build_exactly_the_models(archive_engine: Engine) -> None:
    with archive_engine.connect() as connection:
        context = MigrationContext.configure(
            connection, opts={"compare_type": True, "include_name": include_name}
        )
        assert compare_metadata(context, Base.metadata) == []
    # Names come from the naming convention, the same on both backends.
    inspector = inspect(archive_engine)
    table = "telemetry_rollups"
    assert [uq["name"] for uq in inspector.get_unique_constraints(table)] == [
        "uq_telemetry_rollups_series_period"
    ]
    assert [ck["name"] for ck in inspector.get_check_constraints(table)] == [
        "ck_telemetry_rollups_kind"
    ]
    indexes = inspector.get_indexes(table)  # PostgreSQL lists the unique key's index too
    assert [ix["name"] for ix in indexes if "duplicates_constraint" not in ix] == [
        "ix_telemetry_rollups_node_field_period_start"
    ]


def test_downgrade_to_base_and_back(archive_engine: Engine) -> None:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with archive_engine.begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, "base")
    assert "telemetry_rollups" not in inspect(archive_engine).get_table_names()
    upgrade(archive_engine)
    assert current_revision(archive_engine) == head_revision()


# The columns of probe_runs that later migrations added: 0007 the size, 0009 the node-wide ones.
LATER_THAN_0006 = ("size", "scope", "group_id", "coupling_ratio")


def probe_runs(engine: Engine) -> list[dict[str, object]]:
    with engine.connect() as connection:
        rows = connection.execute(text("SELECT * FROM probe_runs ORDER BY id")).mappings()
        return [dict(row) for row in rows]


def test_upgrade_to_0007_keeps_every_probe_run_and_reads_the_size_from_the_manifest(
    database_url: str,
) -> None:
    """An archive made by the previous head (0006) keeps every row and every value; the new
    ``size`` column comes from each run's manifest where it holds a size, else NULL. Downgrading
    gives back the rows as they were."""
    manifests = [
        ("small", json.dumps({"event": "manifest", "size": "small", "unit": "FLOP/s"})),
        ("default", json.dumps({"event": "manifest", "size": "default"})),
        (None, None),  # a run that failed before its child said anything
        (None, '{"size": "small"'),  # cut short: not JSON
        (None, json.dumps({"size": "small", "work": float("nan")})),  # NaN: not JSON either
        (None, json.dumps({"size": 3})),
        (None, json.dumps(["small"])),
        (None, json.dumps({"event": "manifest"})),
    ]
    runs = [
        probe_run(run_id=f"{index:032x}", manifest=manifest, steady_throughput=7e14 + index)
        for index, (_, manifest) in enumerate(manifests)
    ]
    for run in runs:
        for later in LATER_THAN_0006:  # not columns yet at 0006
            run.pop(later, None)
    engine = open_engine(database_url)
    try:
        upgrade(engine, "0006")
        with engine.begin() as connection:
            connection.execute(insert(ProbeRunRecord), runs)
        before = probe_runs(engine)
        upgrade(engine)
        after = probe_runs(engine)
        assert [{k: v for k, v in row.items() if k not in LATER_THAN_0006} for row in after] == (
            before
        )
        assert [row["size"] for row in after] == [size for size, _ in manifests]
        with engine.connect() as connection:
            results = connection.execute(
                text("SELECT run_id, size FROM probe_results ORDER BY run_id")
            ).all()
        assert [tuple(row) for row in results] == [
            (run["run_id"], size) for run, (size, _) in zip(runs, manifests, strict=True)
        ]
        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.downgrade(config, "0006")
        assert probe_runs(engine) == before
    finally:
        engine.dispose()


def test_upgrade_to_0009_makes_every_earlier_run_a_solo_run(database_url: str) -> None:
    """Every run archived before node-wide runs existed is a solo run (scope ``device``), in the
    table and in the probe_results view; a downgrade drops the node-wide runs (they would read
    as solo runs of their device) and gives back the solo rows as they were."""
    runs = [probe_run(run_id=f"{index:032x}", steady_throughput=7e14 + index) for index in range(3)]
    for run in runs:
        for later in LATER_THAN_0006[1:]:
            run.pop(later, None)
    engine = open_engine(database_url)
    try:
        upgrade(engine, "0008")
        with engine.begin() as connection:
            connection.execute(insert(ProbeRunRecord), runs)
        before = probe_runs(engine)
        upgrade(engine)
        after = probe_runs(engine)
        assert [row["scope"] for row in after] == ["device"] * 3
        assert [row["group_id"] for row in after] == [None] * 3
        node_wide = [
            probe_run(run_id=f"{9 + index:032x}", device=device, scope=scope, group_id="g" * 32)
            for index, (device, scope) in enumerate((("GPU-0", "node"), ("node", "node_total")))
        ]
        with engine.begin() as connection:
            connection.execute(insert(ProbeRunRecord), node_wide)
            scopes = connection.execute(
                text("SELECT scope, COUNT(*) FROM probe_results GROUP BY scope ORDER BY scope")
            ).all()
        assert [tuple(row) for row in scopes] == [("device", 3), ("node", 1), ("node_total", 1)]
        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.downgrade(config, "0008")
        assert probe_runs(engine) == before
    finally:
        engine.dispose()


def alembic(*arguments: str, database_url: str | None) -> subprocess.CompletedProcess[str]:
    """``alembic ...`` run as a developer would, in the repository root (``[tool.alembic]``)."""
    environment = {k: v for k, v in os.environ.items() if k != "SUSTAIN_ARCHIVE__DATABASE_URL"}
    if database_url is not None:
        environment["SUSTAIN_ARCHIVE__DATABASE_URL"] = database_url
    return subprocess.run(
        [sys.executable, "-m", "alembic", *arguments],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_alembic_command_line_upgrades_the_database(database_url: str) -> None:
    result = alembic("upgrade", "head", database_url=database_url)
    assert result.returncode == 0, result.stderr
    engine = open_engine(database_url)
    try:
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()
    # Autogenerate (as ``alembic revision --autogenerate`` runs it) finds nothing to add.
    result = alembic("check", database_url=database_url)
    assert result.returncode == 0, result.stderr
    assert "No new upgrade operations detected" in result.stdout + result.stderr


def test_alembic_command_line_needs_the_url() -> None:
    result = alembic("current", database_url=None)
    assert result.returncode != 0
    assert "SUSTAIN_ARCHIVE__DATABASE_URL is not set" in result.stderr
    assert "Traceback" not in result.stderr


# Opening the database


def test_sqlite_archive_is_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "dir" / "archive.db"
    engine = open_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA journal_mode").scalar_one() == "wal"
            assert connection.exec_driver_sql("PRAGMA synchronous").scalar_one() == 1  # NORMAL
            assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar_one() == 1
    finally:
        engine.dispose()
    with sqlite3.connect(path) as plain:  # WAL is a property of the file, not the connection
        assert plain.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    plain.close()


def test_sqlite_directory_that_cannot_be_created(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    with pytest.raises(ArchiveError) as caught:
        open_engine(f"sqlite:///{tmp_path / 'afile' / 'db.sqlite'}")
    assert str(caught.value) == f"cannot create directory {tmp_path / 'afile'}: Not a directory"


def test_sqlite_read_only_database_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "archive.db"
    open_engine(f"sqlite:///{path}").dispose()
    url = f"sqlite:///file:{path}?mode=ro&uri=true"
    with pytest.raises(ArchiveError) as caught:
        open_engine(url)
    assert str(caught.value) == (
        f"cannot open database sqlite:///file:{path}?mode=ro&uri=true: "
        "attempt to write a readonly database"
    )


def test_sqlite_file_that_cannot_be_opened(tmp_path: Path) -> None:
    (tmp_path / "adir.db").mkdir()
    with pytest.raises(ArchiveError, match=r"^cannot open database sqlite:///.*adir\.db: "):
        open_engine(f"sqlite:///{tmp_path / 'adir.db'}")


def test_unreachable_server_error_hides_the_password() -> None:
    url = "postgresql+psycopg://sustain:Secret-Pw-42@127.0.0.1:1/archive"
    with pytest.raises(ArchiveError) as caught:
        open_engine(url)
    message = str(caught.value)
    assert message == (
        "cannot connect to database postgresql+psycopg://sustain:***@127.0.0.1:1/archive: "
        "connection refused"
    )
    assert "Secret-Pw-42" not in message


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("not a url", "malformed database URL (expected dialect[+driver]://...)"),
        (
            "mysql://u:pw@db/archive",
            "unsupported database mysql://u:***@db/archive: the archive runs on sqlite or "
            "postgresql",
        ),
    ],
)
def test_unusable_urls(url: str, message: str) -> None:
    with pytest.raises(ArchiveError) as caught:
        open_engine(url)
    assert str(caught.value) == message


# Writing rollups


def test_write_stores_the_rows(archive_engine: Engine) -> None:
    before = datetime.now(UTC).replace(microsecond=0)
    rows = [
        rollup(),
        rollup(field="energy_joules", kind="rate", labels="zone=dram", mean=12.5, sample_count=59),
    ]
    assert RollupWriter(archive_engine, "node-a").write(rows) == 2
    first, second = stored(archive_engine)
    assert (first.node, first.collector, first.device, first.field, first.labels) == (
        "node-a",
        "nvml",
        "0",
        "power_watts",
        "",
    )
    assert (first.kind, first.period_seconds, first.sample_count) == ("gauge", 60, 60)
    assert (first.mean, first.min_value, first.max_value, first.p95) == (
        250.5,
        100.25,
        300.0,
        299.5,
    )
    assert first.period_start == datetime(2023, 11, 14, 22, 14, tzinfo=UTC)
    assert first.period_start.utcoffset() is not None
    assert first.period_start.timestamp() == T0
    assert first.created_at.tzinfo == UTC
    assert first.created_at >= before
    assert (second.field, second.labels, second.kind, second.mean) == (
        "energy_joules",
        "zone=dram",
        "rate",
        12.5,
    )


def test_writing_a_batch_twice_keeps_one_copy(archive_engine: Engine) -> None:
    writer = RollupWriter(archive_engine, "node-a")
    rows = [rollup(device=str(index)) for index in range(3)]
    assert writer.write(rows) == 3
    assert writer.write(rows) == 0
    assert writer.write([*rows, rollup(device="3")]) == 1
    assert count(archive_engine) == 4


def test_nodes_do_not_collide(archive_engine: Engine) -> None:
    assert RollupWriter(archive_engine, "node-a").write([rollup()]) == 1
    assert RollupWriter(archive_engine, "node-b").write([rollup()]) == 1


def test_empty_batch(archive_engine: Engine) -> None:
    assert RollupWriter(archive_engine, "node-a").write([]) == 0


def test_a_failing_batch_writes_nothing(archive_engine: Engine) -> None:
    writer = RollupWriter(archive_engine, "node-a")
    good = [rollup(device=str(index)) for index in range(5)]
    bad_rows = [rollup(device="9", kind="peak")]  # violates the kind check constraint
    if archive_engine.dialect.name == "postgresql":  # SQLite does not enforce VARCHAR lengths
        bad_rows.append(rollup(device="x" * 129))
    for bad in bad_rows:
        with pytest.raises(ArchiveError) as caught:
            writer.write([*good, bad])
        message = str(caught.value)
        assert message.startswith("cannot write rollups to ")
        assert "\n" not in message
        assert count(archive_engine) == 0


def test_delete_older_than_deletes_exactly_the_old_rows(archive_engine: Engine) -> None:
    writer = RollupWriter(archive_engine, "node-a")
    writer.write([rollup(period_start=T0 + 60 * index) for index in range(5)])
    RollupWriter(archive_engine, "node-b").write([rollup(period_start=T0)])
    cutoff = datetime.fromtimestamp(T0 + 120, UTC)
    assert writer.delete_older_than(cutoff) == 2
    remaining = sorted((row.node, row.period_start.timestamp()) for row in stored(archive_engine))
    assert remaining == [
        ("node-a", T0 + 120),
        ("node-a", T0 + 180),
        ("node-a", T0 + 240),
        ("node-b", T0),
    ]
    assert writer.delete_older_than(cutoff) == 0


def test_delete_older_than_refuses_a_naive_cutoff(archive_engine: Engine) -> None:
    with pytest.raises(ValueError, match="naive"):
        RollupWriter(archive_engine, "node-a").delete_older_than(datetime(2024, 1, 1))
