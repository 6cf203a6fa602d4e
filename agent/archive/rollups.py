"""Writing telemetry rollups to the archive.

A batch is written in one transaction and every row is keyed by node, series and period, so a
batch retried after an error, or replayed from the spool after an outage, is simply written again:
rows already there are skipped, and nothing is ever half-written or doubled.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, delete
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import SQLAlchemyError

from agent.archive import partitions
from agent.archive.database import archive_error
from agent.archive.models import TelemetryRollup
from agent.telemetry.rollup import RollupRow

_KEY = ("node", "collector", "device", "field", "labels", "period_start")


class RollupWriter:
    """Writes one node's rollups; ``node`` is part of every row's key (a fleet shares one table)."""

    def __init__(self, engine: Engine, node: str) -> None:
        self._engine = engine
        self.node = node
        insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
        self._insert = (
            insert(TelemetryRollup)
            .on_conflict_do_nothing(index_elements=list(_KEY))
            .returning(TelemetryRollup.id)
        )

    def _values(self, row: RollupRow) -> dict[str, Any]:
        return {
            "node": self.node,
            "collector": row.collector,
            "device": row.device,
            "field": row.field,
            "labels": row.labels,
            "kind": row.kind,
            "period_start": datetime.fromtimestamp(row.period_start, UTC),
            "period_seconds": row.period_seconds,
            "mean": row.mean,
            "min_value": row.min,
            "max_value": row.max,
            "p95": row.p95,
            "sample_count": row.sample_count,
        }

    def write(self, rows: Sequence[RollupRow]) -> int:
        """Store ``rows`` all or nothing; return how many were new (0 for a repeated batch)."""
        if not rows:
            return 0
        try:
            with self._engine.begin() as connection:
                return self.insert(connection, rows)
        except SQLAlchemyError as exc:
            raise archive_error("write rollups to", self._engine, exc) from exc

    def insert(self, connection: Connection, rows: Sequence[RollupRow]) -> int:
        """Store ``rows`` in ``connection``'s transaction; return how many were new."""
        if not rows:
            return 0
        # RETURNING yields only the rows inserted, whereas rowcount is unreliable for
        # executemany across drivers.
        values = [self._values(row) for row in rows]
        partitions.ensure_for(connection, "telemetry_rollups", [v["period_start"] for v in values])
        return len(connection.execute(self._insert, values).all())

    def delete_older_than(self, cutoff: datetime) -> int:
        """Delete this node's rollups of periods that started before ``cutoff`` (an aware time).

        Only this node's rows: in a fleet database every agent applies its own retention.
        """
        if cutoff.tzinfo is None:
            raise ValueError(f"naive cutoff {cutoff.isoformat()} (the archive stores UTC)")
        statement = delete(TelemetryRollup).where(
            TelemetryRollup.node == self.node, TelemetryRollup.period_start < cutoff
        )
        try:
            with self._engine.begin() as connection:
                return connection.execute(statement).rowcount
        except SQLAlchemyError as exc:
            raise archive_error("delete old rollups from", self._engine, exc) from exc
