"""``sustain capacity --since`` at 10 million results (issue 28), on PostgreSQL: the rank indexes
that read a quantile's exact value (agent.archive.summary.RANK_INDEXES) are remade in (group,
bucket, ended_at) order with the value included, so that a period's results in one bucket are
one range of them; in (group, bucket, value) order, a period's quantile walked its bucket's
whole history. Each index reads every partition once: plan a few minutes per 10 million runs.
SQLite has no summary: nothing changes there.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-28 13:00:00
"""

from collections.abc import Sequence

from alembic import op

from agent.archive import summary

revision: str = "0014"
down_revision: str | Sequence[str] | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        summary.remake_rank_indexes(bind)


def downgrade() -> None:
    """The rank indexes as migrations 0010 and 0011 made them."""
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    for basis in summary.present(bind)[0]:
        for grouping, column in summary.GROUPINGS.items():
            name, value = summary.RANK_INDEXES[basis, grouping], summary.VALUES[basis]
            bind.exec_driver_sql(f"DROP INDEX IF EXISTS {name}")
            bind.exec_driver_sql(
                f"CREATE INDEX {name} ON probe_runs ({', '.join(summary.GROUP_KEYS)}, {column}, "
                f"sustain_result_bucket({value}), {value}, ended_at) "
                f"WHERE {summary.WHERES[basis]}"
            )
