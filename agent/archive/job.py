"""The scheduled archive job: hand finished rollup periods and noticed events to the archive sink,
and apply each table's retention.

The sink spools everything durably before it reaches the database (agent/archive/sink.py); only
while the spool cannot be written does it hold writes in memory (bounded, what overflows counted
as lost).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import delete, text
from sqlalchemy.exc import SQLAlchemyError

from agent.archive import partitions, summary
from agent.archive.database import ArchiveError, archive_error
from agent.archive.models import EventRecord, ProbeRunRecord, ProbeSeriesRecord, TelemetryRollup
from agent.archive.sink import ArchiveSink, ArchiveStatus
from agent.telemetry.rollup import RollupBuilder
from collectors.base import Sample

log = logging.getLogger(__name__)

DAY = 86_400.0

# Retention on a fleet's PostgreSQL is done by one agent at a time (the bytes of "sustainR").
RETENTION_LOCK_KEY = 0x7375737461696E52


@dataclass(frozen=True, slots=True)
class LocalRollups:
    """A fleet agent's split of its rollups (docs/scale.md): the rollups of ``rollup_seconds``
    go to the node-local SQLite ``sink``; the fleet's PostgreSQL gets only the coarse ones of
    ``coarse`` (a builder of ``archive.fleet_rollup_seconds``), or none."""

    sink: ArchiveSink
    coarse: RollupBuilder | None = None


class ArchiveJob:
    """Moves finished rollup periods and noticed events into the archive sink."""

    def __init__(
        self,
        builder: RollupBuilder,
        sink: ArchiveSink,
        retention_days: float,
        events_retention_days: float | None = None,
        probe_runs_retention_days: float | None = None,
        *,
        local: LocalRollups | None = None,
    ) -> None:
        self._builder = builder
        self.sink = sink
        self.local = local
        self._retention = {
            "telemetry_rollups": retention_days,
            "events": events_retention_days,
            "probe_runs": probe_runs_retention_days,
        }
        self._lock = threading.Lock()  # the scheduler and the shutdown flush may overlap

    def add_events(self, sample: Sample) -> None:
        """Sampler sink: spool the sample's events."""
        if sample.events:
            for event in sample.events:
                log.info("event %s on %s: %s", event.kind, event.device, event.message)
            self.sink.add_events(sample.events)

    def run(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            self._builder.close_periods(now)
            if self.local is None:
                self.sink.add_rollups(self._builder.take())
                return
            self.local.sink.add_rollups(self._builder.take())
            if self.local.coarse is not None:
                self.local.coarse.close_periods(now)
                self.sink.add_rollups(self.local.coarse.take())

    def apply_retention(self, now: float | None = None) -> dict[str, int]:
        """Apply each table's retention; the rows deleted (SQLite) or partitions dropped
        (PostgreSQL) per table.

        SQLite: this node's rows older than the retention are deleted. PostgreSQL (a fleet's
        database, partitioned by month since migration 0010): the months wholly older than the
        retention are dropped, for the whole fleet, never row by row; see ``_drop_partitions``.
        """
        now = time.time() if now is None else now
        if self.local is not None:  # the node's own rollups, in its SQLite file
            kept = self._retention["telemetry_rollups"]
            cutoff = datetime.fromtimestamp(now - (kept or 0) * DAY, UTC)
            try:
                count = self.local.sink.rollups.delete_older_than(cutoff) if kept else 0
            except ArchiveError as exc:
                log.error("retention: %s", exc)
            else:
                if count:
                    log.info("retention: deleted %d local rollup rows older than %s", count, cutoff)
        if self.sink.engine.dialect.name == "postgresql":
            return self._drop_partitions(now)
        deleted: dict[str, int] = {}
        node = self.sink.node
        for table, days in self._retention.items():
            if days is None:
                continue
            cutoff = datetime.fromtimestamp(now - days * DAY, UTC)
            try:
                with self.sink.engine.begin() as connection:
                    if table == "telemetry_rollups":
                        count = connection.execute(
                            delete(TelemetryRollup).where(
                                TelemetryRollup.node == node, TelemetryRollup.period_start < cutoff
                            )
                        ).rowcount
                    elif table == "events":
                        count = connection.execute(
                            delete(EventRecord).where(
                                EventRecord.node == node, EventRecord.occurred_at < cutoff
                            )
                        ).rowcount
                    else:
                        old = (
                            ProbeRunRecord.node == node,
                            ProbeRunRecord.started_at < cutoff,
                            ProbeRunRecord.outcome != "running",
                        )
                        ids = (
                            ProbeRunRecord.__table__.select()
                            .with_only_columns(ProbeRunRecord.run_id)
                            .where(*old)
                        )
                        connection.execute(
                            delete(ProbeSeriesRecord).where(ProbeSeriesRecord.run_id.in_(ids))
                        )
                        count = connection.execute(delete(ProbeRunRecord).where(*old)).rowcount
            except SQLAlchemyError as exc:
                log.error("retention: %s", archive_error(f"trim {table} in", self.sink.engine, exc))
                continue
            deleted[table] = count
            if count:
                log.info("retention: deleted %d %s rows older than %s", count, table, cutoff)
        return deleted

    def _drop_partitions(self, now: float) -> dict[str, int]:
        """PostgreSQL: drop the monthly partitions wholly older than each table's retention
        (probe_series with probe_runs), trim the probe results' summary to what is left, and
        make the coming months' partitions. One agent at a time (an advisory lock: whoever gets
        it does the fleet's work; the others find nothing left). The retention of a fleet's
        database is therefore the shortest any of its agents is configured with."""
        dropped: dict[str, int] = {}
        engine = self.sink.engine
        try:
            with engine.begin() as connection:
                locked = connection.execute(
                    text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": RETENTION_LOCK_KEY}
                ).scalar()
                if not locked:
                    return dropped
                partitions.ensure_around(connection, datetime.fromtimestamp(now, UTC))
                for table, days in self._retention.items():
                    if days is None:
                        continue
                    cutoff = datetime.fromtimestamp(now - days * DAY, UTC)
                    tables = (table, "probe_series") if table == "probe_runs" else (table,)
                    for name in tables:
                        partitions.adopt_strays(connection, name)
                        gone = partitions.drop_older_than(connection, name, cutoff)
                        dropped[name] = len(gone)
                        for partition in gone:
                            log.info(
                                "retention: dropped partition %s (%s older than %s)",
                                partition.name,
                                name,
                                cutoff,
                            )
                    if table == "probe_runs" and dropped.get(table):
                        kept = partitions.oldest_kept(connection, table)
                        if kept is not None:
                            summary.trim(connection, kept)
        except SQLAlchemyError as exc:
            log.error("retention: %s", archive_error("drop old partitions in", engine, exc))
        return dropped

    def status(self) -> ArchiveStatus:
        """The archive's writes; with local rollups, both sinks' together (one spool each)."""
        fleet = self.sink.status()
        if self.local is None:
            return fleet
        local = self.local.sink.status()
        times = [t for t in (fleet.last_write_timestamp, local.last_write_timestamp) if t]
        oldest = [t for t in (fleet.spool_oldest_timestamp, local.spool_oldest_timestamp) if t]
        return ArchiveStatus(
            pending_rows=fleet.pending_rows + local.pending_rows,
            rows_written=fleet.rows_written + local.rows_written,
            pending_events=fleet.pending_events,
            events_written=fleet.events_written,
            write_errors=fleet.write_errors + local.write_errors,
            last_write_timestamp=max(times) if times else None,
            spool_items=fleet.spool_items + local.spool_items,
            spool_bytes=fleet.spool_bytes + local.spool_bytes,
            spool_oldest_timestamp=min(oldest) if oldest else None,
            rejected=fleet.rejected + local.rejected,
            write_conflicts_retried=fleet.write_conflicts_retried + local.write_conflicts_retried,
            up=fleet.up and local.up,
            lost={
                kind: fleet.lost.get(kind, 0) + local.lost.get(kind, 0)
                for kind in fleet.lost.keys() | local.lost.keys()
            },
            spool_errors=fleet.spool_errors + local.spool_errors,
            memory_items=fleet.memory_items + local.memory_items,
            writer_running=fleet.writer_running and local.writer_running,
        )
