"""Events: device lost and recovered, XID errors, and later stack changes and drift.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 00:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("event_id", sa.String(length=32), nullable=False),
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.Column("device", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("occurred_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("attributes", sa.Text(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
        sa.UniqueConstraint("event_id", name=op.f("uq_events_event_id")),
    )
    op.create_index(op.f("ix_events_node_occurred_at"), "events", ["node", "occurred_at"])
    op.create_index(op.f("ix_events_kind_occurred_at"), "events", ["kind", "occurred_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_events_kind_occurred_at"), table_name="events")
    op.drop_index(op.f("ix_events_node_occurred_at"), table_name="events")
    op.drop_table("events")
