"""The archive schema as SQLAlchemy models: the source that Alembic autogenerate compares against.

The tables are only ever created by the migrations in ``migrations/versions``; a test checks that a
freshly migrated database has exactly these tables, columns, types, keys and indexes.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

# Fixed names for every constraint so that later migrations can refer to them by name, and so that
# SQLite (which does not keep unnamed constraint names) and PostgreSQL agree.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(constraint_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """An aware UTC datetime on every backend.

    SQLite keeps no time zone and PostgreSQL answers in the session's zone; converting on the way
    in and out means callers always compare aware UTC values, and a naive value (whose zone is a
    guess) is refused instead of being stored wrongly.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value.isoformat()} (the archive stores UTC)")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class TelemetryRollup(Base):
    """One ``RollupRow``: one series (collector, device, field, labels) of one node, one period.

    The unique key makes writes idempotent, so a batch replayed after a failure or from the spool
    never doubles a period. ``min_value``/``max_value`` hold ``RollupRow.min``/``max`` (names that
    would shadow Python built-ins). ``labels`` is ``""`` for a series without labels, never NULL,
    because NULLs are distinct from each other in a unique key.
    """

    __tablename__ = "telemetry_rollups"
    __table_args__ = (
        UniqueConstraint(
            "node", "collector", "device", "field", "labels", "period_start", name="series_period"
        ),
        CheckConstraint("kind IN ('gauge', 'rate')", name="kind"),
        Index(None, "node", "field", "period_start"),
    )

    # BIGINT does not autoincrement on SQLite (only INTEGER PRIMARY KEY is the rowid).
    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    node: Mapped[str] = mapped_column(String(255))
    collector: Mapped[str] = mapped_column(String(64))
    device: Mapped[str] = mapped_column(String(128))
    field: Mapped[str] = mapped_column(String(128))
    labels: Mapped[str] = mapped_column(String(512))
    kind: Mapped[str] = mapped_column(String(8))
    period_start: Mapped[datetime] = mapped_column(UTCDateTime())
    period_seconds: Mapped[int] = mapped_column(Integer)
    mean: Mapped[float] = mapped_column(Float)
    min_value: Mapped[float] = mapped_column(Float)
    max_value: Mapped[float] = mapped_column(Float)
    p95: Mapped[float] = mapped_column(Float)
    sample_count: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), server_default=func.now())


class EventRecord(Base):
    """One ``collectors.base.Event``: a device lost or recovered, an XID error, ...

    ``event_id`` is made by the agent when the event happens, so a write retried after an
    ambiguous failure stores it once. ``attributes`` is canonical JSON (sorted keys).
    """

    __tablename__ = "events"
    __table_args__ = (
        # With the time: PostgreSQL partitions the table by it (agent.archive.partitions), and a
        # partitioned table's unique keys must hold the partition key. An event keeps its time.
        UniqueConstraint("event_id", "occurred_at", name="event_id"),
        Index(None, "node", "occurred_at"),
        Index(None, "kind", "occurred_at"),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    event_id: Mapped[str] = mapped_column(String(32))
    node: Mapped[str] = mapped_column(String(255))
    device: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(64))
    occurred_at: Mapped[datetime] = mapped_column(UTCDateTime())
    message: Mapped[str] = mapped_column(Text)
    attributes: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), server_default=func.now())


# Which runs ``sustain capacity`` counts, and on which basis (agent.reports.capacity), as SQL:
# the rows of the probe_results view (migration 0005), ok runs with a steady value, count on a
# steady basis; ok runs the analysis found never settled count on a p10 basis, their p10 over
# one-second windows standing in for the steady value (migration 0011); the runs that could have
# given a figure and gave none are left out, each for its reason: failed, timeout, aborted,
# preempted, or ok without a figure (too short to judge, not analysed, under three windows).
# Skipped and unsupported probes never ran, and running ones have not ended: none of the three.
RESULTS_SQL = "outcome = 'ok' AND steady_throughput IS NOT NULL"
P10_RESULTS_SQL = (
    "outcome = 'ok' AND steady_throughput IS NULL AND classification = 'no_steady_state' "
    "AND p10_throughput IS NOT NULL"
)
LEFT_OUT_SQL = (
    "outcome IN ('failed', 'timeout', 'aborted', 'preempted') OR (outcome = 'ok' "
    "AND steady_throughput IS NULL AND (classification IS NULL "
    "OR classification <> 'no_steady_state' OR p10_throughput IS NULL))"
)
RESULTS_WHERE = text(RESULTS_SQL)
P10_RESULTS_WHERE = text(P10_RESULTS_SQL)
LEFT_OUT_WHERE = text(f"({LEFT_OUT_SQL})")  # an OR: grouped, so that an AND beside it binds right
# The columns every capacity group starts with: what a result measured, whose figures are never
# mixed (the size since 0007, the scope since 0009).
RESULT_GROUP = ("precision", "workload", "optimization", "unit", "size", "scope")
# The filters of ``sustain capacity`` besides the time: the columns the runs left out are
# counted by (``ix_probe_runs_left_out``, in this order).
RUN_FILTERS = ("precision", "workload", "optimization", "size", "scope")


class ProbeRunRecord(Base):
    """One probe run: written as ``running`` when it starts and completed when it ends, so a run
    interrupted by the agent's death is found at the next start and marked ``aborted``."""

    __tablename__ = "probe_runs"
    __table_args__ = (
        # With the start: PostgreSQL partitions the table by it (migration 0010); a run's start
        # and end are both written with the same start, so the key still finds the run.
        UniqueConstraint("run_id", "started_at", name="run_id"),
        CheckConstraint(
            "outcome IN ('running', 'ok', 'failed', 'timeout', 'unsupported', 'skipped', "
            "'aborted', 'preempted')",
            name="outcome",
        ),
        Index(None, "node", "device", "workload", "started_at"),
        Index(None, "precision", "workload", "ended_at"),
        Index(None, "stack_id"),
        Index(None, "group_id"),
        # ``sustain capacity`` (agent.reports.capacity): partial indexes of exactly the rows of the
        # probe_results view, each holding every column the query reads, so that neither
        # database reads the table (about 2 KB a run with its JSON) nor sorts a million results.
        # by_device, in group order, gives results, devices and models per group as a stream;
        # by_model and by_stack, in value order within a group, give SQLite its percentiles by
        # rank (and every group order to PostgreSQL's percentile_cont).
        Index(
            "ix_probe_runs_results_by_device",
            *RESULT_GROUP,
            "node",
            "device",
            "device_model",
            "stack_id",
            "ended_at",
            "steady_throughput",
            sqlite_where=RESULTS_WHERE,
            postgresql_where=RESULTS_WHERE,
        ),
        Index(
            "ix_probe_runs_results_by_model",
            *RESULT_GROUP,
            "device_model",
            "steady_throughput",
            "ended_at",
            sqlite_where=RESULTS_WHERE,
            postgresql_where=RESULTS_WHERE,
        ),
        Index(
            "ix_probe_runs_results_by_stack",
            *RESULT_GROUP,
            "stack_id",
            "steady_throughput",
            "ended_at",
            sqlite_where=RESULTS_WHERE,
            postgresql_where=RESULTS_WHERE,
        ),
        # The same three over the runs of the p10 basis (migration 0011), and the runs left out
        # in the order of the filters, with what says why and when: counted from an index that
        # holds them alone, never from the table.
        Index(
            "ix_probe_runs_p10_results_by_device",
            *RESULT_GROUP,
            "node",
            "device",
            "device_model",
            "stack_id",
            "ended_at",
            "p10_throughput",
            sqlite_where=P10_RESULTS_WHERE,
            postgresql_where=P10_RESULTS_WHERE,
        ),
        Index(
            "ix_probe_runs_p10_results_by_model",
            *RESULT_GROUP,
            "device_model",
            "p10_throughput",
            "ended_at",
            sqlite_where=P10_RESULTS_WHERE,
            postgresql_where=P10_RESULTS_WHERE,
        ),
        Index(
            "ix_probe_runs_p10_results_by_stack",
            *RESULT_GROUP,
            "stack_id",
            "p10_throughput",
            "ended_at",
            sqlite_where=P10_RESULTS_WHERE,
            postgresql_where=P10_RESULTS_WHERE,
        ),
        Index(
            "ix_probe_runs_left_out",
            *RUN_FILTERS,
            "outcome",
            "classification",
            "ended_at",
            "started_at",
            sqlite_where=LEFT_OUT_WHERE,
            postgresql_where=LEFT_OUT_WHERE,
        ),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    run_id: Mapped[str] = mapped_column(String(32))
    node: Mapped[str] = mapped_column(String(255))
    device: Mapped[str] = mapped_column(String(128))
    device_label: Mapped[str] = mapped_column(String(64))
    workload: Mapped[str] = mapped_column(String(64))
    precision: Mapped[str] = mapped_column(String(16))
    optimization: Mapped[str] = mapped_column(String(16))
    # The problem size the child ran, as its manifest says: "default", "small", or "default/4"
    # for the default problem divided to fit the duration (migration 0007). NULL for runs
    # archived without a manifest that said it.
    size: Mapped[str | None] = mapped_column(String(32))
    outcome: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    duration_seconds: Mapped[float] = mapped_column(Float)
    iterations: Mapped[int] = mapped_column(Integer)
    throughput: Mapped[float | None] = mapped_column(Float)
    unit: Mapped[str | None] = mapped_column(String(32))
    exit_code: Mapped[int | None] = mapped_column(Integer)
    manifest: Mapped[str | None] = mapped_column(Text)
    result: Mapped[str | None] = mapped_column(Text)
    stderr_tail: Mapped[str] = mapped_column(Text)
    # The steady-state analysis (NULL for runs that were not ok or not analysed).
    classification: Mapped[str | None] = mapped_column(String(24))
    peak_throughput: Mapped[float | None] = mapped_column(Float)
    steady_throughput: Mapped[float | None] = mapped_column(Float)
    steady_ci_low: Mapped[float | None] = mapped_column(Float)
    steady_ci_high: Mapped[float | None] = mapped_column(Float)
    sustained_ratio: Mapped[float | None] = mapped_column(Float)
    steady_start_index: Mapped[int | None] = mapped_column(Integer)
    warmup_seconds: Mapped[float | None] = mapped_column(Float)
    cause: Mapped[str | None] = mapped_column(String(32))
    work_per_joule: Mapped[float | None] = mapped_column(Float)
    analysis: Mapped[str | None] = mapped_column(Text)
    # The stack it ran on and the device's model (migration 0005).
    stack_id: Mapped[str | None] = mapped_column(String(64))
    device_model: Mapped[str | None] = mapped_column(String(128))
    # The steady segment's telemetry, for telling a thermal or power drift from a stack change:
    # means over the segment, and the share of it with a thermal (or power) throttle reason.
    steady_sm_clock_hertz: Mapped[float | None] = mapped_column(Float)
    steady_temperature_celsius: Mapped[float | None] = mapped_column(Float)
    steady_power_watts: Mapped[float | None] = mapped_column(Float)
    steady_thermal_share: Mapped[float | None] = mapped_column(Float)
    steady_power_share: Mapped[float | None] = mapped_column(Float)
    # Throughput percentiles over one-second windows of the whole run (migration 0006): what a
    # run that never settled still delivered.
    p10_throughput: Mapped[float | None] = mapped_column(Float)
    p50_throughput: Mapped[float | None] = mapped_column(Float)
    # Node-wide runs (migration 0009): "device" (solo), "node" (one device's run within a
    # node-wide run) or "node_total" (the node's sum, device "node"); the id that links a
    # node-wide run's rows; node-wide over solo throughput.
    scope: Mapped[str] = mapped_column(String(16), server_default="device")
    group_id: Mapped[str | None] = mapped_column(String(32))
    coupling_ratio: Mapped[float | None] = mapped_column(Float)


class ProbeSeriesRecord(Base):
    """The raw iterations of one run (JSON), kept for audit and re-analysis."""

    __tablename__ = "probe_series"
    __table_args__ = (UniqueConstraint("run_id", "started_at", name="run_id"),)

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    run_id: Mapped[str] = mapped_column(String(32))
    # The run's start (migration 0010): PostgreSQL partitions the series by month as it does
    # the runs, so that retention drops both a month at a time.
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    iterations: Mapped[str] = mapped_column(Text)


class StackSnapshotRecord(Base):
    """One stack (``collectors.stack.StackSnapshot``), stored once however many nodes share it.

    ``facts`` is the canonical JSON whose SHA-256 is ``stack_id``; the version columns repeat a few
    facts for querying and dashboards.
    """

    __tablename__ = "stack_snapshots"
    __table_args__ = (UniqueConstraint("stack_id", name="stack_id"),)

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    stack_id: Mapped[str] = mapped_column(String(64))
    facts: Mapped[str] = mapped_column(Text)
    driver_version: Mapped[str | None] = mapped_column(String(64))
    cuda_version: Mapped[str | None] = mapped_column(String(32))
    torch_version: Mapped[str | None] = mapped_column(String(64))
    first_seen_at: Mapped[datetime] = mapped_column(UTCDateTime())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), server_default=func.now())
