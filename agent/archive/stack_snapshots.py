"""Stack snapshots in the archive: each stack stored once, found by its id or a prefix of it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import SQLAlchemyError

from agent.archive.database import archive_error
from agent.archive.models import EventRecord, StackSnapshotRecord

STACK_CHANGED = "stack_changed"


def snapshot_payload(stack_id: str, facts: dict[str, Any], seen_at: float) -> dict[str, Any]:
    driver = facts.get("driver") or {}
    torch = facts.get("torch") or {}
    return {
        "stack_id": stack_id,
        "facts": json.dumps(facts, sort_keys=True, separators=(",", ":")),
        "driver_version": driver.get("version"),
        "cuda_version": driver.get("cuda_version"),
        "torch_version": torch.get("version"),
        "first_seen_at": seen_at,
    }


def insert_snapshot(connection: Connection, payload: dict[str, Any]) -> None:
    """Store a snapshot unless a node stored the same stack before (the id is its content)."""
    insert = postgresql.insert if connection.dialect.name == "postgresql" else sqlite.insert
    values = payload | {"first_seen_at": datetime.fromtimestamp(payload["first_seen_at"], UTC)}
    connection.execute(
        insert(StackSnapshotRecord)
        .values(values)
        .on_conflict_do_nothing(index_elements=["stack_id"])
    )


@dataclass(frozen=True, slots=True)
class StoredStack:
    stack_id: str
    facts: dict[str, Any]
    first_seen_at: datetime


class StackNotFound(LookupError):
    """No stack, or more than one, matches; the message says which."""


def find(engine: Engine, reference: str) -> StoredStack:
    """The stack whose id is ``reference`` or starts with it (at least 4 hex digits)."""
    prefix = reference.strip().lower()
    if len(prefix) < 4 or any(c not in "0123456789abcdef" for c in prefix):
        raise StackNotFound(f"{reference!r} is not a stack id (4 to 64 hex digits)")
    statement = (
        select(StackSnapshotRecord)
        .where(StackSnapshotRecord.stack_id.startswith(prefix, autoescape=True))
        .limit(2)
    )
    try:
        with engine.connect() as connection:
            found = connection.execute(statement).all()
    except SQLAlchemyError as exc:
        raise archive_error("read stacks from", engine, exc) from exc
    if not found:
        raise StackNotFound(f"no stack {reference} in the archive")
    if len(found) > 1:
        raise StackNotFound(f"stack id prefix {reference} is ambiguous: give more digits")
    row = found[0]
    return StoredStack(row.stack_id, json.loads(row.facts), row.first_seen_at)


def facts_by_id(connection: Connection, stack_ids: set[str]) -> dict[str, dict[str, Any]]:
    if not stack_ids:
        return {}
    rows = connection.execute(
        select(StackSnapshotRecord.stack_id, StackSnapshotRecord.facts).where(
            StackSnapshotRecord.stack_id.in_(sorted(stack_ids))
        )
    ).all()
    return {row.stack_id: json.loads(row.facts) for row in rows}


@dataclass(frozen=True, slots=True)
class StackChange:
    node: str
    occurred_at: datetime
    old: str | None
    new: str
    summary: str


def history(engine: Engine, node: str | None = None) -> list[StackChange]:
    """Every recorded stack change (a node's first stack included), oldest first."""
    statement = select(EventRecord.node, EventRecord.occurred_at, EventRecord.attributes).where(
        EventRecord.kind == STACK_CHANGED
    )
    if node is not None:
        statement = statement.where(EventRecord.node == node)
    statement = statement.order_by(EventRecord.occurred_at, EventRecord.id)
    try:
        with engine.connect() as connection:
            rows = connection.execute(statement).all()
    except SQLAlchemyError as exc:
        raise archive_error("read stack history from", engine, exc) from exc
    changes = []
    for row in rows:
        attributes = json.loads(row.attributes)
        changes.append(
            StackChange(
                node=row.node,
                occurred_at=row.occurred_at,
                old=attributes.get("old") or None,
                new=attributes.get("new", ""),
                summary=attributes.get("summary", ""),
            )
        )
    return changes


def last_stack(engine: Engine, node: str) -> str | None:
    """The stack id this node recorded last (what a restarted agent compares against)."""
    statement = (
        select(EventRecord.attributes)
        .where(EventRecord.kind == STACK_CHANGED, EventRecord.node == node)
        .order_by(EventRecord.occurred_at.desc(), EventRecord.id.desc())
        .limit(1)
    )
    try:
        with engine.connect() as connection:
            row = connection.execute(statement).first()
    except SQLAlchemyError as exc:
        raise archive_error("read stack history from", engine, exc) from exc
    if row is None:
        return None
    new = json.loads(row.attributes).get("new")
    return str(new) if new else None
