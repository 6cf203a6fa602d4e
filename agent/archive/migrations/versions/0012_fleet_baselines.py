"""The fleet's baselines (issue 28): on PostgreSQL, a table of each group's values around the
median (agent.archive.fleet_baselines), which one agent a period fills from the results and
every node reads by key: the drift child's fleet outliers and the health rule
``below_fleet_baseline`` no longer read the peers' results. Empty until the first pass (the
first drift child that finds it due). SQLite has no such fleet: nothing changes there.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-28 00:00:00
"""

from collections.abc import Sequence

from alembic import op

from agent.archive import fleet_baselines

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        for statement in fleet_baselines.CREATE:
            bind.exec_driver_sql(statement)


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        for statement in fleet_baselines.DROP:
            bind.exec_driver_sql(statement)
