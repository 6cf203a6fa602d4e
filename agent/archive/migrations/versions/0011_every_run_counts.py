"""Every run counts for planners (issue 23): an ok run the analysis found never settled counts on
its p10 over one-second windows (the p10 basis) beside the runs with a steady value, and the runs
that gave no figure are counted by why they were left out. On both backends, partial indexes of
exactly those runs, as migration 0005's are of the steady results (``sustain capacity`` reads
indexes, never the table); on PostgreSQL, the summary's p10 basis and its count of the runs left
out (agent.archive.summary), filled from the runs. Nothing is rewritten: the steady results'
indexes, view and summary stay as they were.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-08 00:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from agent.archive import summary

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

P10_RESULTS_WHERE = (
    "outcome = 'ok' AND steady_throughput IS NULL AND classification = 'no_steady_state' "
    "AND p10_throughput IS NOT NULL"
)
LEFT_OUT_WHERE = (
    "outcome IN ('failed', 'timeout', 'aborted', 'preempted') OR (outcome = 'ok' "
    "AND steady_throughput IS NULL AND (classification IS NULL "
    "OR classification <> 'no_steady_state' OR p10_throughput IS NULL))"
)
_GROUP = ["precision", "workload", "optimization", "unit", "size", "scope"]
INDEXES = (
    (
        "ix_probe_runs_p10_results_by_device",
        [*_GROUP, "node", "device", "device_model", "stack_id", "ended_at", "p10_throughput"],
        P10_RESULTS_WHERE,
    ),
    (
        "ix_probe_runs_p10_results_by_model",
        [*_GROUP, "device_model", "p10_throughput", "ended_at"],
        P10_RESULTS_WHERE,
    ),
    (
        "ix_probe_runs_p10_results_by_stack",
        [*_GROUP, "stack_id", "p10_throughput", "ended_at"],
        P10_RESULTS_WHERE,
    ),
    (
        "ix_probe_runs_left_out",
        [
            "precision",
            "workload",
            "optimization",
            "size",
            "scope",
            "outcome",
            "classification",
            "ended_at",
            "started_at",
        ],
        LEFT_OUT_WHERE,
    ),
)


def upgrade() -> None:
    # Plain CREATE INDEX on both backends (partial indexes): no table copy is needed for these.
    for name, columns, where in INDEXES:
        op.create_index(
            name,
            "probe_runs",
            columns,
            sqlite_where=sa.text(where),
            postgresql_where=sa.text(where),
        )
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        summary.create(bind, ("p10",), left_out=True)


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        summary.drop(bind, ("p10",), left_out=True)
    for name, _, _ in reversed(INDEXES):
        op.drop_index(name, table_name="probe_runs")
