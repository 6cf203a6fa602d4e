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
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    """The spool file cannot be opened or written (a full or read-only disk). One line."""


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
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = FULL")
            self._db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise SpoolError(f"cannot open the archive spool {path}: {exc}") from exc

    def append(self, kind: str, payload: Mapping[str, Any], records: int = 1) -> None:
        text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        try:
            with self._lock:
                self._db.execute(
                    "INSERT INTO spool (kind, payload, records, created) VALUES (?, ?, ?, ?)",
                    (kind, text, records, time.time()),
                )
        except sqlite3.Error as exc:
            raise SpoolError(f"cannot write the archive spool {self.path}: {exc}") from exc

    def head(self, limit: int) -> list[SpoolItem]:
        """The oldest ``limit`` items, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, kind, payload, records, created FROM spool ORDER BY seq LIMIT ?",
                (limit,),
            ).fetchall()
        return [SpoolItem(seq, kind, json.loads(text), n, at) for seq, kind, text, n, at in rows]

    def remove(self, seq: int) -> None:
        with self._lock:
            self._db.execute("DELETE FROM spool WHERE seq = ?", (seq,))

    def reject(self, seq: int, error: str) -> None:
        """Move an item the archive refuses for good out of the line, keeping it for inspection."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    "INSERT OR REPLACE INTO rejected "
                    "(seq, kind, payload, created, rejected, error) "
                    "SELECT seq, kind, payload, created, ?, ? FROM spool WHERE seq = ?",
                    (time.time(), error, seq),
                )
                self._db.execute("DELETE FROM spool WHERE seq = ?", (seq,))
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def stats(self) -> SpoolStats:
        with self._lock:
            rows = self._db.execute(
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
            self._db.close()
