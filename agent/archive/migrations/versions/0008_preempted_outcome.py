"""Outcome ``preempted``: a probe run stopped because foreign work arrived on its device (a compute
process on its GPU, or a process taking more than the configured share of the CPUs); its series is
kept, its figures are not stated. A downgrade records such runs as ``aborted`` (stopped before
their end), their reasons, which start with "preempted:", kept.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 00:00:00
"""

from collections.abc import Sequence

from alembic import op
from sqlalchemy import text

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BEFORE = ("running", "ok", "failed", "timeout", "unsupported", "skipped", "aborted")
AFTER = (*BEFORE, "preempted")

# What SQLite's copy of the table would break: the view reading it (the copy fails on it) and the
# partial indexes (the copy loses their WHERE clauses). They are taken down and put back exactly
# as the database wrote them, so this migration repeats no definition of an earlier one.
_DEPENDENTS_SQLITE = """
SELECT type, name, sql FROM sqlite_master
WHERE (type = 'view' AND name = 'probe_results')
   OR (type = 'index' AND tbl_name = 'probe_runs' AND sql LIKE '% WHERE %')
ORDER BY type = 'view', name
"""


def _allow(outcomes: Sequence[str]) -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    dependents = list(op.get_bind().execute(text(_DEPENDENTS_SQLITE))) if sqlite else []
    for kind, name, _ in reversed(dependents):
        op.execute(f'DROP {kind.upper()} "{name}"')
    listed = ", ".join(f"'{outcome}'" for outcome in outcomes)
    with op.batch_alter_table("probe_runs") as batch:
        batch.drop_constraint(op.f("ck_probe_runs_outcome"), type_="check")
        batch.create_check_constraint(op.f("ck_probe_runs_outcome"), f"outcome IN ({listed})")
    for _, _, sql in dependents:
        op.execute(sql)


def upgrade() -> None:
    _allow(AFTER)


def downgrade() -> None:
    op.execute("UPDATE probe_runs SET outcome = 'aborted' WHERE outcome = 'preempted'")
    _allow(BEFORE)
