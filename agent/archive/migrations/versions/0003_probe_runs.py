"""Probe runs and their raw iterations.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21 00:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "probe_runs",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.Column("device", sa.String(length=128), nullable=False),
        sa.Column("device_label", sa.String(length=64), nullable=False),
        sa.Column("workload", sa.String(length=64), nullable=False),
        sa.Column("precision", sa.String(length=16), nullable=False),
        sa.Column("optimization", sa.String(length=16), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("duration_seconds", sa.Float(), nullable=False),
        sa.Column("iterations", sa.Integer(), nullable=False),
        sa.Column("throughput", sa.Float(), nullable=True),
        sa.Column("unit", sa.String(length=32), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("manifest", sa.Text(), nullable=True),
        sa.Column("result", sa.Text(), nullable=True),
        sa.Column("stderr_tail", sa.Text(), nullable=False),
        sa.CheckConstraint(
            "outcome IN ('running', 'ok', 'failed', 'timeout', 'unsupported', 'skipped', "
            "'aborted')",
            name=op.f("ck_probe_runs_outcome"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_probe_runs")),
        sa.UniqueConstraint("run_id", name=op.f("uq_probe_runs_run_id")),
    )
    op.create_index(
        op.f("ix_probe_runs_node_device_workload_started_at"),
        "probe_runs",
        ["node", "device", "workload", "started_at"],
    )
    op.create_table(
        "probe_series",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("iterations", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_probe_series")),
        sa.UniqueConstraint("run_id", name=op.f("uq_probe_series_run_id")),
    )


def downgrade() -> None:
    op.drop_table("probe_series")
    op.drop_index(op.f("ix_probe_runs_node_device_workload_started_at"), table_name="probe_runs")
    op.drop_table("probe_runs")
