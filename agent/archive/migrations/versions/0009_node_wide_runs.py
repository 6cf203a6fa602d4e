"""Node-wide runs: every probe run's ``scope`` (``device`` for a solo run, ``node`` for one
device's run within a node-wide run, ``node_total`` for the node's sum), the ``group_id`` that
links the runs of one node-wide run, and each one's ``coupling_ratio`` (node-wide over solo
throughput). The scope joins the group columns of the capacity indexes and the ``probe_results``
view, so that ``sustain capacity`` never takes the median of solo and node-wide figures; the
existing rows are solo runs.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 00:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_VIEW = """
CREATE VIEW probe_results AS
SELECT run_id, node, device, device_label, device_model, stack_id, workload, precision,
       optimization, size, {scope}started_at, ended_at, unit, classification, peak_throughput,
       steady_throughput, steady_ci_low, steady_ci_high, sustained_ratio, warmup_seconds, cause,
       work_per_joule, steady_sm_clock_hertz, steady_temperature_celsius, steady_power_watts,
       steady_thermal_share, steady_power_share, p10_throughput, p50_throughput
FROM probe_runs
WHERE outcome = 'ok' AND steady_throughput IS NOT NULL
"""
_NODE_COLUMNS = "scope, group_id, coupling_ratio, "

# The covering indexes of ``sustain capacity`` (models.ProbeRunRecord), as migration 0007 left
# them; their group columns gain the scope after the size.
RESULTS_WHERE = "outcome = 'ok' AND steady_throughput IS NOT NULL"
_INDEX_TAILS = (
    (
        "ix_probe_runs_results_by_device",
        ["node", "device", "device_model", "stack_id", "ended_at", "steady_throughput"],
    ),
    ("ix_probe_runs_results_by_model", ["device_model", "steady_throughput", "ended_at"]),
    ("ix_probe_runs_results_by_stack", ["stack_id", "steady_throughput", "ended_at"]),
)
_GROUP = ["precision", "workload", "optimization", "unit", "size"]


def _create_indexes(group: list[str]) -> None:
    for name, tail in _INDEX_TAILS:
        op.create_index(
            name,
            "probe_runs",
            [*group, *tail],
            sqlite_where=sa.text(RESULTS_WHERE),
            postgresql_where=sa.text(RESULTS_WHERE),
        )


def _drop_view_and_indexes() -> None:
    # Before any batch operation: SQLite's table copy would fail on the view and lose the
    # indexes' WHERE clauses.
    op.execute("DROP VIEW probe_results")
    for name, _ in reversed(_INDEX_TAILS):
        op.drop_index(name, table_name="probe_runs")


def upgrade() -> None:
    _drop_view_and_indexes()
    with op.batch_alter_table("probe_runs") as batch:
        batch.add_column(
            sa.Column("scope", sa.String(length=16), nullable=False, server_default="device")
        )
        batch.add_column(sa.Column("group_id", sa.String(length=32), nullable=True))
        batch.add_column(sa.Column("coupling_ratio", sa.Float(), nullable=True))
        batch.create_index(op.f("ix_probe_runs_group_id"), ["group_id"])
    _create_indexes([*_GROUP, "scope"])
    op.execute(_VIEW.format(scope=_NODE_COLUMNS))


def downgrade() -> None:
    _drop_view_and_indexes()
    # The node-wide runs would read as solo runs of the same device: they go.
    op.execute(
        "DELETE FROM probe_series WHERE run_id IN "
        "(SELECT run_id FROM probe_runs WHERE scope <> 'device')"
    )
    op.execute("DELETE FROM probe_runs WHERE scope <> 'device'")
    with op.batch_alter_table("probe_runs") as batch:
        batch.drop_index(op.f("ix_probe_runs_group_id"))
        batch.drop_column("coupling_ratio")
        batch.drop_column("group_id")
        batch.drop_column("scope")
    _create_indexes(_GROUP)
    op.execute(_VIEW.format(scope=""))
