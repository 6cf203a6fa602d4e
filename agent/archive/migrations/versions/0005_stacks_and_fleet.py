"""Stacks and the fleet: stack snapshots, the stack and device model of every probe run, the
steady segment's telemetry (for drift attribution), and the ``probe_results`` view.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22 00:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (
    ("stack_id", sa.String(length=64)),
    ("device_model", sa.String(length=128)),
    ("steady_sm_clock_hertz", sa.Float()),
    ("steady_temperature_celsius", sa.Float()),
    ("steady_power_watts", sa.Float()),
    ("steady_thermal_share", sa.Float()),
    ("steady_power_share", sa.Float()),
)

# One row per analysed ok run: what capacity planners and ``sustain capacity`` read.
PROBE_RESULTS_VIEW = """
CREATE VIEW probe_results AS
SELECT run_id, node, device, device_label, device_model, stack_id, workload, precision,
       optimization, started_at, ended_at, unit, classification, peak_throughput,
       steady_throughput, steady_ci_low, steady_ci_high, sustained_ratio, warmup_seconds, cause,
       work_per_joule, steady_sm_clock_hertz, steady_temperature_celsius, steady_power_watts,
       steady_thermal_share, steady_power_share
FROM probe_runs
WHERE outcome = 'ok' AND steady_throughput IS NOT NULL
"""

# Covering indexes of the view's rows for ``sustain capacity`` (see models.ProbeRunRecord).
RESULTS_WHERE = "outcome = 'ok' AND steady_throughput IS NOT NULL"
_GROUP = ["precision", "workload", "optimization", "unit"]
RESULT_INDEXES = (
    (
        "ix_probe_runs_results_by_device",
        [*_GROUP, "node", "device", "device_model", "stack_id", "ended_at", "steady_throughput"],
    ),
    ("ix_probe_runs_results_by_model", [*_GROUP, "device_model", "steady_throughput", "ended_at"]),
    ("ix_probe_runs_results_by_stack", [*_GROUP, "stack_id", "steady_throughput", "ended_at"]),
)


def upgrade() -> None:
    op.create_table(
        "stack_snapshots",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("stack_id", sa.String(length=64), nullable=False),
        sa.Column("facts", sa.Text(), nullable=False),
        sa.Column("driver_version", sa.String(length=64), nullable=True),
        sa.Column("cuda_version", sa.String(length=32), nullable=True),
        sa.Column("torch_version", sa.String(length=64), nullable=True),
        sa.Column("first_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_stack_snapshots")),
        sa.UniqueConstraint("stack_id", name=op.f("uq_stack_snapshots_stack_id")),
    )
    with op.batch_alter_table("probe_runs") as batch:
        for name, kind in COLUMNS:
            batch.add_column(sa.Column(name, kind, nullable=True))
        batch.create_index(
            "ix_probe_runs_precision_workload_ended_at", ["precision", "workload", "ended_at"]
        )
        batch.create_index("ix_probe_runs_stack_id", ["stack_id"])
    # Plain CREATE INDEX on both backends (partial indexes): no table copy is needed for these.
    for name, columns in RESULT_INDEXES:
        op.create_index(
            name,
            "probe_runs",
            columns,
            sqlite_where=sa.text(RESULTS_WHERE),
            postgresql_where=sa.text(RESULTS_WHERE),
        )
    op.execute(PROBE_RESULTS_VIEW)


def downgrade() -> None:
    op.execute("DROP VIEW probe_results")
    for name, _ in reversed(RESULT_INDEXES):
        op.drop_index(name, table_name="probe_runs")
    with op.batch_alter_table("probe_runs") as batch:
        batch.drop_index("ix_probe_runs_stack_id")
        batch.drop_index("ix_probe_runs_precision_workload_ended_at")
        for name, _ in reversed(COLUMNS):
            batch.drop_column(name)
    op.drop_table("stack_snapshots")
