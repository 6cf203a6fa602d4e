"""Everything the agent archives goes through here: into the spool, then in order into the database.

Producers (the rollup job, the sampler's events, the probe scheduler, the stack tracker) only
append to the local spool, which is fast and durable; one drain thread applies the spool to the
database. A transient failure (the server is down, a connection dropped) stops the drain and it is
retried with a back-off, the item staying first in line; an item the database refuses for good
(a constraint it can never meet) is set aside in the spool's ``rejected`` table with its error,
logged, and counted, so that one bad row cannot hold up everything behind it.

Producers never wait on the spool (a sampler thread must not stall behind a lock another process
holds on the file, or behind the drain): an append goes straight into the spool only when the
spool is free and nothing is held in memory before it; otherwise it joins a bounded in-memory
queue, in order, that the drain thread moves into the spool. So an append is durable once the
drain has moved it (milliseconds, normally), not when ``add_*`` returns. While the spool cannot be
written (a full disk), the drain applies the memory queue straight to the database; what
overflows the queue is dropped and counted (``sustain_archive_lost_total{kind}``, in records).
Every error of the drain, the database's or the spool's, is counted and retried with a back-off:
the drain thread does not die of one (and ``writer_running`` says if it ever did).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from agent.archive.database import archive_error
from agent.archive.events import EventWriter
from agent.archive.probe_runs import ProbeRunWriter
from agent.archive.rollups import RollupWriter
from agent.archive.spool import Spool, SpoolBusy, SpoolError, SpoolItem, SpoolStats, dumps, loads
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
KINDS = ("rollups", "events", "probe_start", "probe_finish", "stack")  # what the spool holds
MEMORY_ITEMS = 10_000  # writes held in memory while the spool cannot take them
CANCEL_GRACE_SECONDS = 1.0  # at stop, for a statement cancelled on the server to return


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
    up: bool = True
    lost: dict[str, int] = field(default_factory=dict)
    spool_errors: int = 0
    memory_items: int = 0
    writer_running: bool = True


@dataclass(frozen=True, slots=True)
class _Held:
    """A write held in memory until the spool (or the database) takes it."""

    kind: str
    text: str
    records: int
    created: float


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

    def __init__(self, engine: Engine, node: str, spool: Spool, *, ready: bool = True) -> None:
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
        self._held: deque[_Held] = deque()
        self._held_lock = threading.Lock()
        self._lost: dict[str, int] = {}
        self._spool_errors = 0
        self._spool_failing = False
        self._last_stats = SpoolStats(0, {}, 0, None)
        self._deadline: float | None = None  # of the drain in progress
        self._active: Any = None  # the DBAPI connection of the write in progress, to cancel
        self.ready = threading.Event()  # the database is open and its schema current
        if ready:
            self.ready.set()

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
        text = dumps(payload)
        with self._held_lock:
            if not self._held:
                try:
                    self.spool.append_text(kind, text, records, time.time(), wait=False)
                except SpoolBusy:
                    pass
                except SpoolError as exc:
                    self._spool_error(exc)
                else:
                    self._wake.set()
                    return
            self._held.append(_Held(kind, text, records, time.time()))
            if len(self._held) > MEMORY_ITEMS:
                dropped = self._held.popleft()
                with self._counts_lock:
                    self._lost[dropped.kind] = self._lost.get(dropped.kind, 0) + dropped.records
                log.error(
                    "archive write lost: %s (%d records): the spool cannot take writes and %d "
                    "are held in memory already",
                    dropped.kind,
                    dropped.records,
                    MEMORY_ITEMS,
                )
        self._wake.set()

    def _spool_error(self, exc: SpoolError) -> None:
        with self._counts_lock:
            self._spool_errors += 1
        if not self._spool_failing:
            log.error("%s; holding archive writes in memory and retrying", exc)
            self._spool_failing = True

    # The drain ---------------------------------------------------------------------------------

    def start_draining(self) -> None:
        self._thread = threading.Thread(target=self._run, name="archive-drain", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Drain now (the archive just opened) rather than at the next idle wake."""
        self._wake.set()

    @property
    def writer_running(self) -> bool:
        """False when the drain thread ended other than by ``stop``."""
        thread = self._thread
        return thread is None or thread.is_alive() or self._stopping.is_set()

    def stop(self, timeout: float) -> bool:
        """Stop the thread and drain what can be drained in ``timeout``; True when empty. A
        write still running when the time is half gone is cancelled (on the server)."""
        deadline = time.monotonic() + timeout
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout / 2)
            if self._thread.is_alive():
                self._cancel()
                self._thread.join(min(CANCEL_GRACE_SECONDS, max(0.0, deadline - time.monotonic())))
        return self.drain(deadline=deadline)

    def _cancel(self) -> None:
        active = self._active
        cancel = getattr(active, "cancel", None) or getattr(active, "interrupt", None)
        if cancel is None:
            return
        try:
            cancel()
        except Exception as exc:  # noqa: BLE001 - best effort at shutdown, and said so
            log.warning("could not cancel the archive write in progress: %s", exc)

    def _run(self) -> None:
        backoff = 1.0
        while not self._stopping.is_set():
            try:
                done = self.ready.is_set() and self.drain()
            except Exception:
                # Whatever it was, the thread goes on: the items stay where they were.
                log.exception("archive drain failed; retrying")
                with self._counts_lock:
                    self._write_errors += 1
                done = False
            if done or not self.ready.is_set():
                backoff = 1.0
                self._wake.wait(IDLE_WAKE_SECONDS)
                self._wake.clear()
            else:
                # Appends do not cut a back-off short: a failing server is not hammered.
                self._stopping.wait(backoff)
                backoff = min(MAX_BACKOFF_SECONDS, backoff * 2)

    def drain(self, deadline: float | None = None) -> bool:
        """Move held writes into the spool, then apply spooled items in order until both are
        empty (True), a write fails or the deadline passes (False)."""
        wait = -1.0 if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._drain_lock.acquire(timeout=wait):
            return False
        self._deadline = deadline
        try:
            spooled = self._flush_held()
            while deadline is None or time.monotonic() < deadline:
                try:
                    items = self.spool.head(BATCH)
                except SpoolError as exc:
                    self._spool_error(exc)
                    items = []
                    spooled = False
                if not items:
                    return spooled or self._apply_held(deadline)
                for item in items:
                    if not self._apply_one(item):
                        return False
                    if deadline is not None and time.monotonic() >= deadline:
                        return False
            return False
        finally:
            self._drain_lock.release()

    def _flush_held(self) -> bool:
        """Move the writes held in memory into the spool, oldest first; False when the spool
        cannot take them (they stay held)."""
        while True:
            with self._held_lock:
                if not self._held:
                    break
                held = self._held[0]
            try:
                self.spool.append_text(held.kind, held.text, held.records, held.created)
            except SpoolError as exc:
                self._spool_error(exc)
                return False
            with self._held_lock:
                if self._held and self._held[0] is held:
                    self._held.popleft()
        if self._spool_failing:
            log.info("the archive spool %s takes writes again", self.spool.path)
            self._spool_failing = False
        return True

    def _apply_held(self, deadline: float | None) -> bool:
        """The spool cannot take writes: apply the held ones straight to the database."""
        while deadline is None or time.monotonic() < deadline:
            with self._held_lock:
                if not self._held:
                    return True
                held = self._held[0]
            item = SpoolItem(0, held.kind, loads(held.text), held.records, held.created)
            if not self._write(item, deadline, spooled=False):
                return False
            with self._held_lock:
                if self._held and self._held[0] is held:
                    self._held.popleft()
        return False

    def _apply_one(self, item: SpoolItem) -> bool:
        return self._write(item, self._deadline)

    def _write(self, item: SpoolItem, deadline: float | None, *, spooled: bool = True) -> bool:
        try:
            written = self._apply_retrying_conflicts(item, deadline)
        except SQLAlchemyError as exc:
            error = str(archive_error(f"write {item.kind} to", self.engine, exc))
            if not _transient(exc):
                return self._reject(item, error, spooled=spooled)
            with self._counts_lock:
                self._write_errors += 1
            if not self._failing:
                log.error("archive unreachable, keeping writes in %s: %s", self.spool.path, error)
                self._failing = True
            return False
        except (KeyError, TypeError, ValueError) as exc:  # a payload this agent cannot read
            return self._reject(item, f"unreadable {item.kind} payload: {exc!r}", spooled=spooled)
        if self._failing:
            log.info("archive reachable again, replaying the spool")
            self._failing = False
        with self._counts_lock:
            if item.kind == "rollups":
                self._rows_written += written
            elif item.kind == "events":
                self._events_written += written
            self._last_write = time.time()
        if spooled:
            try:
                self.spool.remove(item.seq)
            except SpoolError as exc:  # written: a replay stores it once
                self._spool_error(exc)
                return False
        return True

    def _apply_retrying_conflicts(self, item: SpoolItem, deadline: float | None = None) -> int:
        for attempt in range(1, CONFLICT_RETRIES + 1):
            try:
                with self.engine.begin() as connection:
                    self._active = connection.connection.dbapi_connection
                    try:
                        self._limit(connection, deadline)
                        return self._apply(connection, item)
                    finally:
                        self._active = None
            except SQLAlchemyError as exc:
                if attempt == CONFLICT_RETRIES or not _conflict(exc):
                    raise
                with self._counts_lock:
                    self._conflicts_retried += 1
                jitter = 0.5 + random.random()  # noqa: S311 - spreads retries, guards no secret
                time.sleep(CONFLICT_PAUSE_SECONDS * attempt * jitter)
        raise AssertionError("unreachable: the last attempt returns or raises")

    @staticmethod
    def _limit(connection: Connection, deadline: float | None) -> None:
        """Under a deadline (the drain at stop), no PostgreSQL statement outlives it."""
        if deadline is None or connection.dialect.name != "postgresql":
            return
        milliseconds = max(1, int((deadline - time.monotonic()) * 1000))
        connection.exec_driver_sql(f"SET LOCAL statement_timeout = {milliseconds}")

    def _reject(self, item: SpoolItem, error: str, *, spooled: bool = True) -> bool:
        if spooled:
            try:
                self.spool.reject(item.seq, error)
            except SpoolError as exc:
                self._spool_error(exc)
                return False
            where = "kept in the spool's rejected table"
        else:
            with self._counts_lock:
                self._lost[item.kind] = self._lost.get(item.kind, 0) + item.records
            where = "lost: the spool cannot take it"
        with self._counts_lock:
            self._rejected += 1
        log.error("archive refused %s (%s): %s", item.kind, where, error)
        return True

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
        try:
            stats = self._last_stats = self.spool.stats()
        except SpoolError:
            stats = self._last_stats  # what was last seen; the failure is counted by the drain
        with self._held_lock:
            held = len(self._held)
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
                rejected=self._rejected + self.spool.malformed,
                write_conflicts_retried=self._conflicts_retried,
                up=self.ready.is_set() and not self._failing,
                lost=dict(self._lost),
                spool_errors=self._spool_errors,
                memory_items=held,
                writer_running=self.writer_running,
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
