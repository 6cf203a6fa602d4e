"""A write that collides with another writer's transaction on PostgreSQL is retried at once.

The pgbouncer test once saw "deadlock detected" on a probe_start while eight agents wrote at once:
PostgreSQL ends one of two colliding transactions and asks the client to retry it. Here the real
server raises the real SQLSTATEs (40P01 deadlock_detected, 40001 serialization_failure) from a
trigger on the events table, for as many inserts as the test says, so the retry path runs against
the same errors a fleet's writers meet.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from agent.archive.database import open_engine, upgrade
from agent.archive.sink import CONFLICT_RETRIES, ArchiveSink
from agent.archive.spool import Spool
from collectors.base import Event


@pytest.fixture
def engine(postgres_url: str) -> Iterator[Engine]:
    engine = open_engine(postgres_url)
    upgrade(engine)
    yield engine
    engine.dispose()


def collide(engine: Engine, times: int, errcode: str) -> None:
    """The next ``times`` inserts into events fail with ``errcode``, as a colliding writer's
    would. The count is a sequence: the failing transaction rolls back, a sequence does not."""
    with engine.begin() as connection:
        connection.execute(text("CREATE SEQUENCE collided"))
        connection.execute(
            text(
                f"""
                CREATE FUNCTION collide() RETURNS trigger AS $$
                BEGIN
                  IF nextval('collided') <= {times} THEN
                    RAISE EXCEPTION 'collision' USING ERRCODE = '{errcode}';
                  END IF;
                  RETURN NEW;
                END $$ LANGUAGE plpgsql
                """
            )
        )
        connection.execute(
            text(
                "CREATE TRIGGER collide BEFORE INSERT ON events "
                "FOR EACH ROW EXECUTE FUNCTION collide()"
            )
        )


def sink_with_one_event(engine: Engine, tmp_path: Path) -> tuple[ArchiveSink, Event]:
    sink = ArchiveSink(engine, "node-a", Spool(tmp_path / "spool.db"))
    event = Event("throttle_episode", "GPU-0", 1_780_000_000.0, "sw_power_cap")
    sink.add_events([event])
    return sink, event


@pytest.mark.parametrize("errcode", ["40P01", "40001"])
def test_a_collision_is_retried_at_once_and_is_no_error(
    engine: Engine, tmp_path: Path, errcode: str
) -> None:
    collide(engine, 2, errcode)
    sink, event = sink_with_one_event(engine, tmp_path)
    assert sink.drain() is True
    status = sink.status()
    assert (status.write_errors, status.write_conflicts_retried, status.spool_items) == (0, 2, 0)
    with engine.connect() as connection:
        ids = connection.execute(text("SELECT event_id FROM events")).scalars().all()
    assert ids == [event.id]
    sink.spool.close()


def test_a_collision_that_persists_is_an_error_and_the_write_stays_spooled(
    engine: Engine, tmp_path: Path
) -> None:
    collide(engine, 1000, "40P01")
    sink, _ = sink_with_one_event(engine, tmp_path)
    assert sink.drain() is False
    status = sink.status()
    assert status.write_errors == 1
    assert status.write_conflicts_retried == CONFLICT_RETRIES - 1
    assert status.spool_items == 1  # nothing lost: it is first in line for the next drain
    sink.spool.close()
