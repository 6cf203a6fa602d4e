"""Windowed throughput percentiles: p10 and p50 of each analysed run over one-second windows, so a
run that never settles still states what it delivered; the ``probe_results`` view carries them.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24 00:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("p10_throughput", "p50_throughput")

_VIEW_COLUMNS = """run_id, node, device, device_label, device_model, stack_id, workload, precision,
       optimization, started_at, ended_at, unit, classification, peak_throughput,
       steady_throughput, steady_ci_low, steady_ci_high, sustained_ratio, warmup_seconds, cause,
       work_per_joule, steady_sm_clock_hertz, steady_temperature_celsius, steady_power_watts,
       steady_thermal_share, steady_power_share"""
_VIEW = """
CREATE VIEW probe_results AS
SELECT {columns}
FROM probe_runs
WHERE outcome = 'ok' AND steady_throughput IS NOT NULL
"""


def upgrade() -> None:
    op.execute("DROP VIEW probe_results")
    with op.batch_alter_table("probe_runs") as batch:
        for name in COLUMNS:
            batch.add_column(sa.Column(name, sa.Float(), nullable=True))
    op.execute(_VIEW.format(columns=f"{_VIEW_COLUMNS}, p10_throughput, p50_throughput"))


def downgrade() -> None:
    op.execute("DROP VIEW probe_results")
    with op.batch_alter_table("probe_runs") as batch:
        for name in reversed(COLUMNS):
            batch.drop_column(name)
    op.execute(_VIEW.format(columns=_VIEW_COLUMNS))
