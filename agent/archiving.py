"""The scheduled archive job: write finished rollup periods and events, and apply retention.

A failed write hands its rows back so the next run retries them in order; rows and events are
idempotent in the database, so a retry after an ambiguous failure cannot duplicate them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from agent.archive.database import ArchiveError
from agent.archive.events import EventWriter
from agent.archive.rollups import RollupWriter
from agent.rollup import RollupBuilder
from collectors.base import Event, Sample

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ArchiveStatus:
    pending_rows: int
    rows_written: int
    pending_events: int
    events_written: int
    write_errors: int
    last_write_timestamp: float | None


class ArchiveJob:
    """Moves finished rollup periods and noticed events into the archive."""

    def __init__(
        self,
        builder: RollupBuilder,
        rollups: RollupWriter,
        events: EventWriter,
        retention_days: float,
    ) -> None:
        self._builder = builder
        self._rollups = rollups
        self._events = events
        self._retention = timedelta(days=retention_days)
        self._lock = threading.Lock()  # the scheduler and the shutdown flush may overlap
        self._events_lock = threading.Lock()
        self._pending_events: list[Event] = []
        self._rows_written = 0
        self._events_written = 0
        self._write_errors = 0
        self._last_write: float | None = None

    def add_events(self, sample: Sample) -> None:
        """Sampler sink: keep the sample's events for the next run."""
        if sample.events:
            with self._events_lock:
                self._pending_events.extend(sample.events)
            for event in sample.events:
                log.info("event %s on %s: %s", event.kind, event.device, event.message)

    def run(self, now: float | None = None) -> None:
        with self._lock:
            self._builder.close_periods(time.time() if now is None else now)
            rows = self._builder.take()
            with self._events_lock:
                events, self._pending_events = self._pending_events, []
            if not rows and not events:
                return
            try:
                self._events.write(events)
                self._events_written += len(events)
                events = []
                self._rollups.write(rows)
                self._rows_written += len(rows)
            except ArchiveError as exc:
                self._builder.give_back(rows)
                with self._events_lock:
                    self._pending_events[:0] = events
                self._write_errors += 1
                log.error(
                    "archive write failed, %d rows and %d events kept for retry: %s",
                    len(rows),
                    len(events),
                    exc,
                )
                return
            self._last_write = time.time()

    def apply_retention(self) -> None:
        cutoff = datetime.now(UTC) - self._retention
        try:
            deleted = self._rollups.delete_older_than(cutoff)
        except ArchiveError as exc:
            log.error("retention failed: %s", exc)
            return
        if deleted:
            log.info("retention: deleted %d rollup rows older than %s", deleted, cutoff.isoformat())

    def status(self) -> ArchiveStatus:
        # No job lock here: a scrape must not wait for a slow database write.
        with self._events_lock:
            pending_events = len(self._pending_events)
        return ArchiveStatus(
            pending_rows=self._builder.pending,
            rows_written=self._rows_written,
            pending_events=pending_events,
            events_written=self._events_written,
            write_errors=self._write_errors,
            last_write_timestamp=self._last_write,
        )
