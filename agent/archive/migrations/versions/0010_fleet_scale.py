"""Fleet scale: on PostgreSQL, probe_runs, probe_series, events and telemetry_rollups become
tables partitioned by month of their time column (retention then drops whole months), and a
daily summary of the probe results, kept by a trigger, serves ``sustain capacity``
(agent.archive.summary). On both backends, the unique keys of runs, series and events take the
time column (a partitioned table's unique keys must hold its partition key) and probe_series
gains the run's ``started_at``. Every row is kept: PostgreSQL copies each table into its
partitioned successor, ids included; SQLite alters its plain tables in place.

The summary's SQL comes from agent.archive.summary: its steady basis, the part this revision made
(``create``'s arguments name it); a later revision adds its parts with a migration of its own
(0011: the p10 basis and the runs left out).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-24 00:00:00
"""

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

from agent.archive import summary

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_VIEW = """
CREATE VIEW probe_results AS
SELECT run_id, node, device, device_label, device_model, stack_id, workload, precision,
       optimization, size, scope, group_id, coupling_ratio, started_at, ended_at, unit,
       classification, peak_throughput, steady_throughput, steady_ci_low, steady_ci_high,
       sustained_ratio, warmup_seconds, cause, work_per_joule, steady_sm_clock_hertz,
       steady_temperature_celsius, steady_power_watts, steady_thermal_share, steady_power_share,
       p10_throughput, p50_throughput
FROM probe_runs
WHERE outcome = 'ok' AND steady_throughput IS NOT NULL
"""

# Each table, its time column, and its unique key (the time column last).
_TABLES = (
    (
        "telemetry_rollups",
        "period_start",
        "uq_telemetry_rollups_series_period",
        "node, collector, device, field, labels, period_start",
    ),
    ("events", "occurred_at", "uq_events_event_id", "event_id, occurred_at"),
    ("probe_runs", "started_at", "uq_probe_runs_run_id", "run_id, started_at"),
    ("probe_series", "started_at", "uq_probe_series_run_id", "run_id, started_at"),
)

# The unique keys before this revision, for the downgrade.
_OLD_KEYS = {
    "events": ["event_id"],
    "probe_runs": ["run_id"],
    "probe_series": ["run_id"],
}


def _months(first: datetime, last: datetime) -> list[tuple[int, int]]:
    months = []
    year, month = first.year, first.month
    while (year, month) <= (last.year, last.month):
        months.append((year, month))
        year, month = (year + 1, 1) if month == 12 else (year, month + 1)
    return months


def _create_partitions(table: str, months: list[tuple[int, int]]) -> None:
    for year, month in months:
        start = datetime(year, month, 1, tzinfo=UTC)
        end = datetime(year + (month == 12), month % 12 + 1, 1, tzinfo=UTC)
        op.execute(
            f'CREATE TABLE IF NOT EXISTS "{table}_p{year:04d}{month:02d}" PARTITION OF "{table}" '
            f"FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')"
        )


def _partition_postgresql(table: str, column: str, unique: str, unique_columns: str) -> None:
    bind = op.get_bind()
    old = f"{table}_unpartitioned"
    op.execute(f'ALTER TABLE "{table}" RENAME TO "{old}"')
    # The indexes that are not keys come back as they were, on the new table.
    definitions = [
        row.indexdef.replace(f" ON public.{old} ", f" ON public.{table} ")
        for row in bind.execute(
            sa.text(
                "SELECT i.indexdef FROM pg_indexes i WHERE i.schemaname = 'public' "
                "AND i.tablename = :old AND NOT EXISTS (SELECT 1 FROM pg_constraint c "
                "WHERE c.conname = i.indexname AND c.conrelid = to_regclass(:old))"
            ),
            {"old": old},
        )
    ]
    for name in bind.execute(
        sa.text("SELECT indexname FROM pg_indexes WHERE schemaname = 'public' AND tablename = :t"),
        {"t": old},
    ).scalars():
        constraint = bind.execute(
            sa.text(
                "SELECT 1 FROM pg_constraint WHERE conname = :n AND conrelid = to_regclass(:t)"
            ),
            {"n": name, "t": old},
        ).first()
        if constraint:
            op.execute(f'ALTER TABLE "{old}" DROP CONSTRAINT "{name}"')
        else:
            op.execute(f'DROP INDEX "{name}"')
    extra = ", started_at timestamp with time zone NOT NULL" if table == "probe_series" else ""
    op.execute(
        f'CREATE TABLE "{table}" (LIKE "{old}" INCLUDING DEFAULTS INCLUDING CONSTRAINTS{extra}) '
        f"PARTITION BY RANGE ({column})"
    )
    # The id sequence now belongs to the new table (dropping the old one would take it along).
    op.execute(f'ALTER SEQUENCE {table}_id_seq OWNED BY "{table}".id')
    op.execute(f'ALTER TABLE "{table}" ADD CONSTRAINT "pk_{table}" PRIMARY KEY (id, {column})')
    op.execute(f'ALTER TABLE "{table}" ADD CONSTRAINT "{unique}" UNIQUE ({unique_columns})')
    if table == "probe_series":
        # A series whose run is gone (it cannot happen through the agent) is kept, as of now.
        time = "coalesce(r.started_at, now())"
        rows = f'"{old}" s LEFT JOIN probe_runs r ON r.run_id = s.run_id'
        source = f"SELECT s.id, s.run_id, s.iterations, {time} FROM {rows}"
        into = f'"{table}" (id, run_id, iterations, started_at)'
    else:
        time, rows = column, f'"{old}"'
        source, into = f"SELECT * FROM {rows}", f'"{table}"'
    first, last = bind.execute(sa.text(f"SELECT min({time}), max({time}) FROM {rows}")).one()
    now = datetime.now(UTC)
    months = _months(min(first or now, now).astimezone(UTC), max(last or now, now).astimezone(UTC))
    # From the oldest row to two months ahead (agent.archive.partitions keeps it so).
    ahead = months[-1]
    for _ in range(2):
        ahead = (ahead[0] + 1, 1) if ahead[1] == 12 else (ahead[0], ahead[1] + 1)
        months.append(ahead)
    _create_partitions(table, months)
    # Rows of months without a partition of their own (written by a bulk load or a tool, not
    # the agent's writers) land here until agent.archive.partitions gives them one.
    op.execute(f'CREATE TABLE "{table}_default" PARTITION OF "{table}" DEFAULT')
    op.execute(f"INSERT INTO {into} {source}")
    op.execute(
        f"SELECT setval('{table}_id_seq', coalesce((SELECT max(id) FROM \"{table}\"), 0) + 1, "
        "false)"
    )
    op.execute(f'DROP TABLE "{old}"')
    for definition in definitions:
        op.execute(definition)


def _sqlite_keys(columns: dict[str, list[str]]) -> None:
    for table, key in columns.items():
        with op.batch_alter_table(table) as batch:
            batch.drop_constraint(f"uq_{table}_{'event_id' if table == 'events' else 'run_id'}")
            batch.create_unique_constraint("event_id" if table == "events" else "run_id", key)


def upgrade() -> None:
    bind = op.get_bind()
    op.execute("DROP VIEW probe_results")
    if bind.dialect.name == "postgresql":
        for table, column, unique, unique_columns in _TABLES:
            if table == "probe_series":
                continue  # after probe_runs (it takes the runs' start), first below
            if table == "probe_runs":
                # The series first: it reads the runs' start from the table as it was.
                _partition_postgresql("probe_series", "started_at", *_TABLES[3][2:])
            _partition_postgresql(table, column, unique, unique_columns)
        op.execute(_VIEW)
        summary.create(bind, ("steady",), left_out=False)
        return
    # SQLite: plain tables, new keys; the series gains the run's start.
    with op.batch_alter_table("probe_series") as batch:
        batch.add_column(sa.Column("started_at", sa.DateTime(timezone=True), nullable=True))
    op.execute(
        "UPDATE probe_series SET started_at = coalesce((SELECT r.started_at FROM probe_runs r "
        "WHERE r.run_id = probe_series.run_id), CURRENT_TIMESTAMP)"
    )
    with op.batch_alter_table("probe_series") as batch:
        batch.alter_column("started_at", existing_type=sa.DateTime(timezone=True), nullable=False)
    _sqlite_keys(
        {
            "events": ["event_id", "occurred_at"],
            "probe_series": ["run_id", "started_at"],
        }
    )
    _sqlite_probe_runs(["run_id", "started_at"])
    op.execute(_VIEW)


# The partial indexes of ``sustain capacity`` (migration 0009's), which SQLite's table copy
# would lose the WHERE clauses of: dropped before, made again after.
_RESULTS_WHERE = "outcome = 'ok' AND steady_throughput IS NOT NULL"
_GROUP = ["precision", "workload", "optimization", "unit", "size", "scope"]
_INDEX_TAILS = (
    (
        "ix_probe_runs_results_by_device",
        ["node", "device", "device_model", "stack_id", "ended_at", "steady_throughput"],
    ),
    ("ix_probe_runs_results_by_model", ["device_model", "steady_throughput", "ended_at"]),
    ("ix_probe_runs_results_by_stack", ["stack_id", "steady_throughput", "ended_at"]),
)


def _sqlite_probe_runs(key: list[str]) -> None:
    for name, _ in _INDEX_TAILS:
        op.drop_index(name, table_name="probe_runs")
    with op.batch_alter_table("probe_runs") as batch:
        batch.drop_constraint("uq_probe_runs_run_id")
        batch.create_unique_constraint("run_id", key)
    for name, tail in _INDEX_TAILS:
        op.create_index(
            name,
            "probe_runs",
            [*_GROUP, *tail],
            sqlite_where=sa.text(_RESULTS_WHERE),
            postgresql_where=sa.text(_RESULTS_WHERE),
        )


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        # The partitioned tables stay partitioned (their rows would not fit the old unique keys
        # if a run id were ever reused); only the summary goes.
        summary.drop(bind)
        return
    op.execute("DROP VIEW probe_results")
    _sqlite_probe_runs(_OLD_KEYS["probe_runs"])
    _sqlite_keys({"events": _OLD_KEYS["events"], "probe_series": _OLD_KEYS["probe_series"]})
    with op.batch_alter_table("probe_series") as batch:
        batch.drop_column("started_at")
    op.execute(_VIEW)
