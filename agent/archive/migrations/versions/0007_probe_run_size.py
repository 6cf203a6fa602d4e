"""The problem size of every probe run as a column (``default``, ``small``, ``default/4``), in the
``probe_results`` view and among the group columns of the capacity indexes, so that ``sustain
capacity`` never takes the median of two sizes. Until now it was only in the manifest JSON: the
existing rows get it from there (NULL where the manifest is missing, not JSON, or has no size
string).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25 00:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SIZE_LENGTH = 32  # as in the SQL below

_VIEW = """
CREATE VIEW probe_results AS
SELECT run_id, node, device, device_label, device_model, stack_id, workload, precision,
       optimization, {size}started_at, ended_at, unit, classification, peak_throughput,
       steady_throughput, steady_ci_low, steady_ci_high, sustained_ratio, warmup_seconds, cause,
       work_per_joule, steady_sm_clock_hertz, steady_temperature_celsius, steady_power_watts,
       steady_thermal_share, steady_power_share, p10_throughput, p50_throughput
FROM probe_runs
WHERE outcome = 'ok' AND steady_throughput IS NOT NULL
"""

# The covering indexes of ``sustain capacity`` (models.ProbeRunRecord), whose group columns gain
# the size after the unit.
RESULTS_WHERE = "outcome = 'ok' AND steady_throughput IS NOT NULL"
_INDEX_TAILS = (
    (
        "ix_probe_runs_results_by_device",
        ["node", "device", "device_model", "stack_id", "ended_at", "steady_throughput"],
    ),
    ("ix_probe_runs_results_by_model", ["device_model", "steady_throughput", "ended_at"]),
    ("ix_probe_runs_results_by_stack", ["stack_id", "steady_throughput", "ended_at"]),
)
_GROUP = ["precision", "workload", "optimization", "unit"]

# json_valid first: json_type raises on text that is not JSON, and CASE evaluates lazily.
_BACKFILL_SQLITE = """
UPDATE probe_runs SET size = CASE WHEN json_valid(manifest) THEN
    CASE WHEN json_type(manifest, '$.size') = 'text'
         THEN substr(json_extract(manifest, '$.size'), 1, 32) END
END
WHERE manifest IS NOT NULL
"""
# PostgreSQL's cast raises on text that is not JSON (Python's json writes NaN, for one): a
# temporary function turns that into NULL for the one row instead of failing the upgrade.
_SIZE_FUNCTION_POSTGRESQL = """
CREATE FUNCTION pg_temp.sustain_manifest_size(manifest text) RETURNS text
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    document jsonb;
BEGIN
    document := manifest::jsonb;
    IF jsonb_typeof(document -> 'size') = 'string' THEN
        RETURN left(document ->> 'size', 32);
    END IF;
    RETURN NULL;
EXCEPTION WHEN data_exception THEN
    RETURN NULL;
END
$$
"""
_BACKFILL_POSTGRESQL = """
UPDATE probe_runs SET size = pg_temp.sustain_manifest_size(manifest) WHERE manifest IS NOT NULL
"""


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
        batch.add_column(sa.Column("size", sa.String(length=SIZE_LENGTH), nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_SIZE_FUNCTION_POSTGRESQL)
        op.execute(_BACKFILL_POSTGRESQL)
        op.execute("DROP FUNCTION pg_temp.sustain_manifest_size(text)")
    else:
        op.execute(_BACKFILL_SQLITE)
    _create_indexes([*_GROUP, "size"])
    op.execute(_VIEW.format(size="size, "))


def downgrade() -> None:
    _drop_view_and_indexes()
    with op.batch_alter_table("probe_runs") as batch:
        batch.drop_column("size")
    _create_indexes(_GROUP)
    op.execute(_VIEW.format(size=""))
