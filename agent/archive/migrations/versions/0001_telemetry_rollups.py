"""Telemetry rollups: one row per node, series and period.

Revision ID: 0001
Revises:
Create Date: 2026-01-01 00:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "telemetry_rollups",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.Column("collector", sa.String(length=64), nullable=False),
        sa.Column("device", sa.String(length=128), nullable=False),
        sa.Column("field", sa.String(length=128), nullable=False),
        sa.Column("labels", sa.String(length=512), nullable=False),
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("period_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("period_seconds", sa.Integer(), nullable=False),
        sa.Column("mean", sa.Float(), nullable=False),
        sa.Column("min_value", sa.Float(), nullable=False),
        sa.Column("max_value", sa.Float(), nullable=False),
        sa.Column("p95", sa.Float(), nullable=False),
        sa.Column("sample_count", sa.Integer(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.CheckConstraint("kind IN ('gauge', 'rate')", name=op.f("ck_telemetry_rollups_kind")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_telemetry_rollups")),
        sa.UniqueConstraint(
            "node",
            "collector",
            "device",
            "field",
            "labels",
            "period_start",
            name=op.f("uq_telemetry_rollups_series_period"),
        ),
    )
    op.create_index(
        op.f("ix_telemetry_rollups_node_field_period_start"),
        "telemetry_rollups",
        ["node", "field", "period_start"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index(
        op.f("ix_telemetry_rollups_node_field_period_start"), table_name="telemetry_rollups"
    )
    op.drop_table("telemetry_rollups")
