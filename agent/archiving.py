"""The scheduled archive jobs: write finished rollup periods, and apply retention.

A failed write hands its rows back to the builder so the next run retries them in order; rows are
idempotent in the database, so a retry after an ambiguous failure cannot duplicate them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from agent.archive.database import ArchiveError
from agent.archive.rollups import RollupWriter
from agent.rollup import RollupBuilder

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ArchiveStatus:
    pending_rows: int
    rows_written: int
    write_errors: int
    last_write_timestamp: float | None


class RollupJob:
    """Moves finished periods from the builder into the archive."""

    def __init__(self, builder: RollupBuilder, writer: RollupWriter, retention_days: float) -> None:
        self._builder = builder
        self._writer = writer
        self._retention = timedelta(days=retention_days)
        self._lock = threading.Lock()  # the scheduler and the shutdown flush may overlap
        self._rows_written = 0
        self._write_errors = 0
        self._last_write: float | None = None

    def run(self, now: float | None = None) -> None:
        with self._lock:
            self._builder.close_periods(time.time() if now is None else now)
            rows = self._builder.take()
            if not rows:
                return
            try:
                self._writer.write(rows)
            except ArchiveError as exc:
                self._builder.give_back(rows)
                self._write_errors += 1
                log.error("rollup write failed, %d rows kept for retry: %s", len(rows), exc)
                return
            self._rows_written += len(rows)
            self._last_write = time.time()

    def apply_retention(self) -> None:
        cutoff = datetime.now(UTC) - self._retention
        try:
            deleted = self._writer.delete_older_than(cutoff)
        except ArchiveError as exc:
            log.error("retention failed: %s", exc)
            return
        if deleted:
            log.info("retention: deleted %d rollup rows older than %s", deleted, cutoff.isoformat())

    def status(self) -> ArchiveStatus:
        # No job lock here: a scrape must not wait for a slow database write.
        return ArchiveStatus(
            pending_rows=self._builder.pending,
            rows_written=self._rows_written,
            write_errors=self._write_errors,
            last_write_timestamp=self._last_write,
        )
