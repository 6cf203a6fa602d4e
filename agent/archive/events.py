"""Writing events to the archive, idempotently (each event carries its own id)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import SQLAlchemyError

from agent.archive import partitions
from agent.archive.database import archive_error
from agent.archive.models import EventRecord
from collectors.base import Event


class EventWriter:
    """Writes one node's events; a batch is all or nothing, a repeated event is skipped."""

    def __init__(self, engine: Engine, node: str) -> None:
        self._engine = engine
        self.node = node
        insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
        self._insert = (
            insert(EventRecord)
            .on_conflict_do_nothing(index_elements=["event_id", "occurred_at"])
            .returning(EventRecord.id)
        )

    def _values(self, event: Event) -> dict[str, Any]:
        return {
            "event_id": event.id,
            "node": self.node,
            "device": event.device,
            "kind": event.kind,
            "occurred_at": datetime.fromtimestamp(event.timestamp, UTC),
            "message": event.message,
            "attributes": json.dumps(dict(event.attributes), sort_keys=True),
        }

    def write(self, events: Sequence[Event]) -> int:
        """Store ``events``; return how many were new."""
        if not events:
            return 0
        try:
            with self._engine.begin() as connection:
                return self.insert(connection, events)
        except SQLAlchemyError as exc:
            raise archive_error("write events to", self._engine, exc) from exc

    def insert(self, connection: Connection, events: Sequence[Event]) -> int:
        """Store ``events`` in ``connection``'s transaction; return how many were new."""
        if not events:
            return 0
        values = [self._values(e) for e in events]
        partitions.ensure_for(connection, "events", [v["occurred_at"] for v in values])
        return len(connection.execute(self._insert, values).all())
