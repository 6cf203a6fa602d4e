"""A durable local queue in front of the archive: nothing the agent measures waits in memory alone.

Every archive write (rollups, events, probe runs, stack snapshots) is first appended to a SQLite
file on the node (``archive.spool_path``, synchronous=FULL: an append survives a kill -9 or a
power cut once ``append`` returns); a drain thread then applies the items to the archive database
strictly in order, each in its own transaction, and deletes an item only after its transaction
committed. Every apply is idempotent (client-made ids, unique keys, upserts), so an item replayed
after a crash between the commit and the delete is stored once. While the database is unreachable
the items wait here (``sustain_archive_spool_*`` shows the backlog) and are retried with a
back-off; later items never overtake earlier ones, so a probe run's start is written before its
end. The spool is one file per agent, never shared: SQLite's locking is only trusted locally.

Nothing here stops the agent: a spool file that is not a database (or whose rows cannot be read)
is renamed aside (``spool.db.corrupt-<time>``, logged once) and a fresh one made; a spool that
cannot be opened at all (a full or read-only disk) is opened again at the next use, and until then
every operation raises ``SpoolError``, which the sink counts and answers by holding the writes in
memory (agent/archive/sink.py). A row whose payload is not JSON is moved to ``rejected`` as the
database's refusals are, and counted (``malformed``).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

BUSY_TIMEOUT_MS = 1000  # the drain's wait for another process's lock; producers never wait

_SCHEMA = """
CREATE TABLE IF NOT EXISTS spool (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    payload TEXT NOT NULL,
    records INTEGER NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS rejected (
    seq INTEGER PRIMARY KEY,
    kind TEXT NOT NULL,
    payload TEXT NOT NULL,
    created REAL NOT NULL,
    rejected REAL NOT NULL,
    error TEXT NOT NULL
);
"""


class SpoolError(Exception):
    """The spool file cannot be opened, read or written (a full or read-only disk, a lock another
    process holds). One line."""


class SpoolBusy(SpoolError):
    """The spool is in use (by the drain or another process): a producer does not wait."""


@dataclass(frozen=True, slots=True)
class SpoolItem:
    seq: int
    kind: str
    payload: dict[str, Any]
    records: int
    created: float


@dataclass(frozen=True, slots=True)
class SpoolStats:
    items: int
    records_by_kind: dict[str, int]
    bytes: int
    oldest_created: float | None


class Spool:
    """A FIFO of (kind, JSON payload) in a SQLite file, safe to use from several threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._closed = False
        self.malformed = 0  # rows whose payload was not JSON, moved to ``rejected``
        self.open_error: str | None = None
        try:
            self._open()
        except SpoolError as exc:
            self.open_error = str(exc)
            log.error("%s; holding archive writes in memory until it can be opened", exc)

    def _open(self) -> sqlite3.Connection:
        """The connection, opened (again) if need be; a corrupt file is set aside first."""
        if self._db is not None:
            return self._db
        if self._closed:
            raise SpoolError(f"the archive spool {self.path} is closed")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self._db = self._connect()
            except sqlite3.OperationalError:
                raise  # locked, full, read-only: the file may be fine
            except sqlite3.DatabaseError as exc:  # not a database, or a malformed one
                self._set_aside(exc)
                self._db = self._connect()
        except (OSError, sqlite3.Error) as exc:
            raise SpoolError(f"cannot open the archive spool {self.path}: {exc}") from exc
        self.open_error = None
        return self._db

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=0)
        try:
            db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = FULL")
            db.executescript(_SCHEMA)
            db.execute("SELECT COUNT(*) FROM spool").fetchone()
        except BaseException:
            db.close()
            raise
        return db

    def _set_aside(self, exc: sqlite3.DatabaseError) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        for suffix in ("", "-wal", "-shm"):
            source = Path(f"{self.path}{suffix}")
            if source.exists():
                os.replace(source, Path(f"{aside}{suffix}"))
        log.error(
            "the archive spool %s cannot be read (%s): moved aside to %s, starting a fresh one",
            self.path,
            exc,
            aside,
        )

    def append(self, kind: str, payload: Mapping[str, Any], records: int = 1) -> None:
        self.append_text(kind, dumps(payload), records, time.time())

    def append_text(
        self, kind: str, text: str, records: int, created: float, *, wait: bool = True
    ) -> None:
        """Append an encoded payload; with ``wait=False`` raise ``SpoolBusy`` rather than wait
        for the lock (the drain's, or another process's on the file)."""
        if not self._lock.acquire(blocking=wait):
            raise SpoolBusy(f"the archive spool {self.path} is busy")
        try:
            db = self._open()
            if not wait:
                db.execute("PRAGMA busy_timeout = 0")
            try:
                db.execute(
                    "INSERT INTO spool (kind, payload, records, created) VALUES (?, ?, ?, ?)",
                    (kind, text, records, created),
                )
            finally:
                if not wait:
                    db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        except sqlite3.OperationalError as exc:
            if not wait and "locked" in str(exc):
                raise SpoolBusy(f"the archive spool {self.path} is busy: {exc}") from exc
            raise SpoolError(f"cannot write the archive spool {self.path}: {exc}") from exc
        except sqlite3.Error as exc:
            raise SpoolError(f"cannot write the archive spool {self.path}: {exc}") from exc
        finally:
            self._lock.release()

    def head(self, limit: int) -> list[SpoolItem]:
        """The oldest ``limit`` items, oldest first; a row that is not JSON is set aside."""
        items: list[SpoolItem] = []
        with self._guard("read") as db:
            rows = db.execute(
                "SELECT seq, kind, payload, records, created FROM spool ORDER BY seq LIMIT ?",
                (limit,),
            ).fetchall()
        for seq, kind, text, n, at in rows:
            try:
                payload = loads(text)
            except (TypeError, ValueError) as exc:
                self.reject(seq, f"malformed {kind} payload in the spool: {exc}")
                self.malformed += 1
                log.error("set aside a malformed %s item of the spool (seq %d): %s", kind, seq, exc)
                continue
            items.append(SpoolItem(seq, kind, payload, n, at))
        return items

    def remove(self, seq: int) -> None:
        with self._guard("write") as db:
            db.execute("DELETE FROM spool WHERE seq = ?", (seq,))

    def reject(self, seq: int, error: str) -> None:
        """Move an item the archive refuses for good out of the line, keeping it for inspection."""
        with self._guard("write") as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute(
                    "INSERT OR REPLACE INTO rejected "
                    "(seq, kind, payload, created, rejected, error) "
                    "SELECT seq, kind, payload, created, ?, ? FROM spool WHERE seq = ?",
                    (time.time(), error, seq),
                )
                db.execute("DELETE FROM spool WHERE seq = ?", (seq,))
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    @contextmanager
    def _guard(self, action: str) -> Iterator[sqlite3.Connection]:
        """The connection under the lock; every SQLite failure as one ``SpoolError``."""
        with self._lock:
            try:
                yield self._open()
            except sqlite3.Error as exc:
                raise SpoolError(f"cannot {action} the archive spool {self.path}: {exc}") from exc

    def stats(self) -> SpoolStats:
        with self._guard("read") as db:
            rows = db.execute(
                "SELECT kind, COUNT(*), SUM(records), SUM(LENGTH(payload)), MIN(created) "
                "FROM spool GROUP BY kind"
            ).fetchall()
        oldest = [row[4] for row in rows]
        return SpoolStats(
            items=sum(row[1] for row in rows),
            records_by_kind={row[0]: int(row[2]) for row in rows},
            bytes=sum(int(row[3]) for row in rows),
            oldest_created=min(oldest) if oldest else None,
        )

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
            self._closed = True


def dumps(payload: Mapping[str, Any]) -> str:
    return json.dumps(payload, sort_keys=True, separators=(",", ":"))


def loads(text: str) -> dict[str, Any]:
    payload = json.loads(text)
    if not isinstance(payload, dict):
        raise TypeError(f"not an object: {type(payload).__name__}")
    return payload
