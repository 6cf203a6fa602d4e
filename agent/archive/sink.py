"""Everything the agent archives goes through here: into the spool, then in order into the database.

Producers (the rollup job, the sampler's events, the probe scheduler, the stack tracker) only
append to the local spool, which is fast and durable; one drain thread applies the spool to the
database. A transient failure (the server is down, a connection dropped) stops the drain and it is
retried with a back-off, the item staying first in line; an item the database refuses for good
(a constraint it can never meet) is set aside in the spool's ``rejected`` table with its error,
logged, and counted, so that one bad row cannot hold up everything behind it.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from agent.archive.database import archive_error
from agent.archive.events import EventWriter
from agent.archive.probe_runs import ProbeRunWriter
from agent.archive.rollups import RollupWriter
from agent.archive.spool import Spool, SpoolError, SpoolItem
from agent.archive.stack_snapshots import insert_snapshot, snapshot_payload
from agent.probes.analysis import RunAnalysis
from agent.probes.runner import ProbeRun, ProbeSpec
from agent.telemetry.rollup import RollupRow
from collectors.base import Event

log = logging.getLogger(__name__)

BATCH = 200
MAX_BACKOFF_SECONDS = 30.0
IDLE_WAKE_SECONDS = 5.0
CONFLICT_SQLSTATES = frozenset({"40001", "40P01"})  # serialization_failure, deadlock_detected
CONFLICT_RETRIES = 5
CONFLICT_PAUSE_SECONDS = 0.05  # times the attempt, with jitter so colliding writers part ways


@dataclass(frozen=True, slots=True)
class ArchiveStatus:
    pending_rows: int
    rows_written: int
    pending_events: int
    events_written: int
    write_errors: int
    last_write_timestamp: float | None
    spool_items: int
    spool_bytes: int
    spool_oldest_timestamp: float | None
    rejected: int
    write_conflicts_retried: int = 0


def _conflict(exc: SQLAlchemyError) -> bool:
    """Two writers' transactions collided (PostgreSQL's deadlock or serialization failure, as
    when agents of a fleet update the same summary rows): retrying at once succeeds, and the
    server asks clients to do so. Not an outage, so not a write error."""
    sqlstate = getattr(getattr(exc, "orig", None), "sqlstate", None)
    return sqlstate in CONFLICT_SQLSTATES


def _transient(exc: SQLAlchemyError) -> bool:
    """A failure worth retrying: the server, the network or a lock, not the data."""
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return True
        name = type(exc).__name__
        return name in ("OperationalError", "InterfaceError", "InternalError")
    return True  # pool timeouts, disconnects before a statement ran


class ArchiveSink:
    """The spool, the drain thread and the writers for one node."""

    def __init__(self, engine: Engine, node: str, spool: Spool) -> None:
        self.engine = engine
        self.node = node
        self.spool = spool
        self.rollups = RollupWriter(engine, node)
        self.events = EventWriter(engine, node)
        self.probe_runs = ProbeRunWriter(engine, node)
        self._drain_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._counts_lock = threading.Lock()
        self._rows_written = 0
        self._events_written = 0
        self._write_errors = 0
        self._conflicts_retried = 0
        self._rejected = 0
        self._last_write: float | None = None
        self._failing = False

    # Producers ---------------------------------------------------------------------------------

    def add_rollups(self, rows: Sequence[RollupRow]) -> None:
        if rows:
            payload = {"rows": [dataclasses.asdict(row) for row in rows]}
            self._append("rollups", payload, len(rows))

    def add_events(self, events: Sequence[Event]) -> None:
        if events:
            self._append("events", {"events": [_event(e) for e in events]}, len(events))

    def start(self, run_id: str, spec: ProbeSpec, started_at: float) -> None:
        """A probe run started (the ``ProbeArchive`` side of the sink)."""
        self._append("probe_start", self.probe_runs.start_payload(run_id, spec, started_at))

    def finish(
        self,
        run: ProbeRun,
        *,
        analysis: RunAnalysis | None = None,
        stack_id: str | None = None,
        coupling: float | None = None,
    ) -> None:
        """A probe run ended: its whole row, its series and the stack it ran on."""
        payload = self.probe_runs.finish_payload(
            run, analysis=analysis, stack_id=stack_id, coupling=coupling
        )
        self._append("probe_finish", payload)

    def add_stack(self, stack_id: str, facts: dict[str, Any], seen_at: float) -> None:
        self._append("stack", snapshot_payload(stack_id, facts, seen_at))

    def _append(self, kind: str, payload: dict[str, Any], records: int = 1) -> None:
        try:
            self.spool.append(kind, payload, records)
        except SpoolError as exc:
            # The disk is full or gone: try the database directly rather than drop the data.
            log.error("%s; writing %s directly", exc, kind)
            item = SpoolItem(0, kind, payload, records, time.time())
            try:
                with self.engine.begin() as connection:
                    self._apply(connection, item)
            except SQLAlchemyError as db_exc:
                log.error("%s lost: %s", kind, archive_error("write to", self.engine, db_exc))
            return
        self._wake.set()

    # The drain ---------------------------------------------------------------------------------

    def start_draining(self) -> None:
        self._thread = threading.Thread(target=self._run, name="archive-drain", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> bool:
        """Stop the thread and drain what can be drained in ``timeout``; True when empty."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.drain(deadline=time.monotonic() + timeout)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(IDLE_WAKE_SECONDS)
            self._wake.clear()
            backoff = 1.0
            # Appends do not cut a back-off short: a failing server is not hammered.
            while not self._stopping.is_set() and not self.drain():
                self._stopping.wait(backoff)
                backoff = min(MAX_BACKOFF_SECONDS, backoff * 2)

    def drain(self, deadline: float | None = None) -> bool:
        """Apply spooled items in order until the spool is empty (True) or a write fails."""
        with self._drain_lock:
            while deadline is None or time.monotonic() < deadline:
                items = self.spool.head(BATCH)
                if not items:
                    return True
                for item in items:
                    if not self._apply_one(item):
                        return False
            return False

    def _apply_one(self, item: SpoolItem) -> bool:
        try:
            written = self._apply_retrying_conflicts(item)
        except SQLAlchemyError as exc:
            error = str(archive_error(f"write {item.kind} to", self.engine, exc))
            if not _transient(exc):
                self._reject(item, error)
                return True
            with self._counts_lock:
                self._write_errors += 1
            if not self._failing:
                log.error("archive unreachable, keeping writes in %s: %s", self.spool.path, error)
                self._failing = True
            return False
        except (KeyError, TypeError, ValueError) as exc:  # a payload this agent cannot read
            self._reject(item, f"unreadable {item.kind} payload: {exc!r}")
            return True
        self.spool.remove(item.seq)
        if self._failing:
            log.info("archive reachable again, replaying the spool")
            self._failing = False
        with self._counts_lock:
            if item.kind == "rollups":
                self._rows_written += written
            elif item.kind == "events":
                self._events_written += written
            self._last_write = time.time()
        return True

    def _apply_retrying_conflicts(self, item: SpoolItem) -> int:
        for attempt in range(1, CONFLICT_RETRIES + 1):
            try:
                with self.engine.begin() as connection:
                    return self._apply(connection, item)
            except SQLAlchemyError as exc:
                if attempt == CONFLICT_RETRIES or not _conflict(exc):
                    raise
                with self._counts_lock:
                    self._conflicts_retried += 1
                jitter = 0.5 + random.random()  # noqa: S311 - spreads retries, guards no secret
                time.sleep(CONFLICT_PAUSE_SECONDS * attempt * jitter)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _reject(self, item: SpoolItem, error: str) -> None:
        self.spool.reject(item.seq, error)
        with self._counts_lock:
            self._rejected += 1
        log.error("archive refused %s (kept in the spool's rejected table): %s", item.kind, error)

    def _apply(self, connection: Connection, item: SpoolItem) -> int:
        payload = item.payload
        if item.kind == "rollups":
            rows = [RollupRow(**row) for row in payload["rows"]]
            self.rollups.insert(connection, rows)
            return len(rows)
        if item.kind == "events":
            events = [_from_event(e) for e in payload["events"]]
            self.events.insert(connection, events)
            return len(events)
        if item.kind in ("probe_start", "probe_finish"):
            self.probe_runs.apply(connection, item.kind, payload)
            return 1
        if item.kind == "stack":
            insert_snapshot(connection, payload)
            return 1
        raise ValueError(f"unknown spool item kind {item.kind!r}")

    def status(self) -> ArchiveStatus:
        stats = self.spool.stats()
        with self._counts_lock:
            return ArchiveStatus(
                pending_rows=stats.records_by_kind.get("rollups", 0),
                rows_written=self._rows_written,
                pending_events=stats.records_by_kind.get("events", 0),
                events_written=self._events_written,
                write_errors=self._write_errors,
                last_write_timestamp=self._last_write,
                spool_items=stats.items,
                spool_bytes=stats.bytes,
                spool_oldest_timestamp=stats.oldest_created,
                rejected=self._rejected,
                write_conflicts_retried=self._conflicts_retried,
            )


def _event(event: Event) -> dict[str, Any]:
    return {
        "id": event.id,
        "kind": event.kind,
        "device": event.device,
        "timestamp": event.timestamp,
        "message": event.message,
        "attributes": [list(pair) for pair in event.attributes],
    }


def _from_event(data: dict[str, Any]) -> Event:
    return Event(
        kind=data["kind"],
        device=data["device"],
        timestamp=data["timestamp"],
        message=data["message"],
        attributes=tuple((str(k), str(v)) for k, v in data["attributes"]),
        id=data["id"],
    )
