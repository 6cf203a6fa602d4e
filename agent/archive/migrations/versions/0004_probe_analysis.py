"""Probe runs: the steady-state analysis and the attribution of a slowdown.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-21 00:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (
    ("classification", sa.String(length=24)),
    ("peak_throughput", sa.Float()),
    ("steady_throughput", sa.Float()),
    ("steady_ci_low", sa.Float()),
    ("steady_ci_high", sa.Float()),
    ("sustained_ratio", sa.Float()),
    ("steady_start_index", sa.Integer()),
    ("warmup_seconds", sa.Float()),
    ("cause", sa.String(length=32)),
    ("work_per_joule", sa.Float()),
    ("analysis", sa.Text()),
)


def upgrade() -> None:
    with op.batch_alter_table("probe_runs") as batch:
        for name, kind in COLUMNS:
            batch.add_column(sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("probe_runs") as batch:
        for name, _ in reversed(COLUMNS):
            batch.drop_column(name)
