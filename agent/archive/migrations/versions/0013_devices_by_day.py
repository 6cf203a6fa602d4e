"""Fleet readers at 10 million results (issue 28), on PostgreSQL: for ``sustain capacity
--since``, the summary counts the devices of each group by the day of their latest result
(``probe_result_devices_by_day`` of each basis, filled from ``probe_result_devices`` and kept by
the trigger from now on), and two indexes of the runs by the instant they count at read the rest
of a period's first day from the runs (agent.archive.summary); for the fleet baselines' outlier
pass, an index of the solo results in its order (agent.archive.fleet_baselines.SERIES_INDEX).
Each index reads every partition once: plan a few minutes per 10 million runs. SQLite has
neither summary nor baselines: nothing changes there.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-28 10:00:00
"""

from collections.abc import Sequence

from alembic import op

from agent.archive import fleet_baselines, summary

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        summary.create_by_day(bind)
        bind.exec_driver_sql(fleet_baselines.CREATE_SERIES_INDEX)


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        bind.exec_driver_sql(f"DROP INDEX IF EXISTS {fleet_baselines.SERIES_INDEX}")
        summary.drop_by_day(bind)
