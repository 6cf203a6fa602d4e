"""The scheduled archive job: hand finished rollup periods and noticed events to the archive sink,
and apply each table's retention.

The sink spools everything durably before it reaches the database (agent/archive/sink.py), so
nothing handed over here is held in memory only.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime

from sqlalchemy import delete
from sqlalchemy.exc import SQLAlchemyError

from agent.archive.database import archive_error
from agent.archive.models import EventRecord, ProbeRunRecord, ProbeSeriesRecord, TelemetryRollup
from agent.archive.sink import ArchiveSink, ArchiveStatus
from agent.telemetry.rollup import RollupBuilder
from collectors.base import Sample

log = logging.getLogger(__name__)

DAY = 86_400.0


class ArchiveJob:
    """Moves finished rollup periods and noticed events into the archive sink."""

    def __init__(
        self,
        builder: RollupBuilder,
        sink: ArchiveSink,
        retention_days: float,
        events_retention_days: float | None = None,
        probe_runs_retention_days: float | None = None,
    ) -> None:
        self._builder = builder
        self.sink = sink
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
        with self._lock:
            self._builder.close_periods(time.time() if now is None else now)
            self.sink.add_rollups(self._builder.take())

    def apply_retention(self, now: float | None = None) -> dict[str, int]:
        """Delete this node's rows older than each table's retention; the counts deleted.

        Only this node's rows: in a fleet database every agent applies its own retention.
        """
        now = time.time() if now is None else now
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

    def status(self) -> ArchiveStatus:
        return self.sink.status()
