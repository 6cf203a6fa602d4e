"""``sustain capacity --since`` at fleet scale (issue 28): on PostgreSQL, the summary counts the
devices of each group by the day of their latest result (``probe_result_devices_by_day`` of each
basis, filled from ``probe_result_devices`` and kept by the trigger from now on), and two
indexes of the runs by the instant they count at read the rest of a period's first day from the
runs (agent.archive.summary). SQLite has no summary: nothing changes there.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-28 10:00:00
"""

from collections.abc import Sequence

from alembic import op

from agent.archive import summary

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        summary.create_by_day(bind)


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        summary.drop_by_day(bind)
