"""The fleet's baselines (agent.archive.fleet_baselines): a group's three values around its
median give the median of the group without any one member, exactly as statistics.median
over the others would; and the election lets one pass a period through.

The answers against the peers' rows on a seeded fleet are in tests/test_fleet.py."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import Engine, text

from agent.archive import fleet_baselines
from agent.archive.database import open_engine, upgrade
from agent.archive.fleet_baselines import Middle

VALUES = st.lists(
    st.floats(min_value=1e-3, max_value=1e18, allow_nan=False, allow_infinity=False)
    | st.sampled_from([1.0, 2.0, 3.0]),  # ties
    min_size=1,
    max_size=40,
)


@given(VALUES)
def test_the_middle_gives_the_median_without_each_member(values: list[float]) -> None:
    ordered = sorted(values)
    middle = Middle.of(ordered)
    assert len(middle.values) <= 3
    assert middle.median() == statistics.median(values)
    for index, value in enumerate(values):
        others = values[:index] + values[index + 1 :]
        expected = statistics.median(others) if others else None
        assert middle.median(value) == expected, (values, value)


@given(VALUES, st.floats(min_value=0.0, max_value=2e18, allow_nan=False))
def test_a_value_the_pass_did_not_see_leaves_out_one_member_still(
    values: list[float], stranger: float
) -> None:
    """A node's own value that moved since the pass (a late result): the median is that of the
    group without one member (the nearest), so never out of the group's range."""
    middle = Middle.of(sorted(values))
    median = middle.median(stranger)
    if len(values) == 1:
        assert median is None
        return
    assert median is not None
    candidates = {statistics.median(values[:i] + values[i + 1 :]) for i in range(len(values))}
    assert median in candidates


def test_a_stored_middle_reads_back_the_same() -> None:
    middle = Middle.of([1.5, 2.25, 1e15, 3.0000000000000004])

    class Row:
        steady_count = middle.count
        steady_first = middle.first
        steady_middle = middle.as_row("steady")["steady_middle"]

    assert Middle.from_row(Row(), "steady") == middle


@pytest.fixture
def fleet_engine(postgres_url: str) -> Iterator[Engine]:
    engine = open_engine(postgres_url)
    upgrade(engine)
    yield engine
    engine.dispose()


def test_one_agent_makes_the_pass_once_a_period(fleet_engine: Engine) -> None:
    now = datetime(2026, 11, 28, 12, tzinfo=UTC)
    due = {"interval_seconds": 3600.0, "baseline_days": 7.0}
    assert fleet_baselines.present(fleet_engine)
    assert fleet_baselines.refresh_if_due(fleet_engine, now=now, **due)
    # An empty archive makes no group, and no row says when: the table is read by its cutoff
    # only where there are groups, so record one to see the period kept.
    with fleet_engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO fleet_baselines VALUES ('outlier', 'matmul', 'bf16', 'eager', '', "
                "'H100', 's', 3, 3, 0, '[1.0, 2.0, 3.0]', 0, 0, '[]', NULL, :cutoff, 0)"
            ),
            {"cutoff": now},
        )
    later = now + timedelta(minutes=30)
    assert not fleet_baselines.refresh_if_due(fleet_engine, now=later, **due)
    # Another agent holding the lock (making the pass): this one leaves it to that one.
    with fleet_engine.connect() as other, other.begin():
        other.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": fleet_baselines.LOCK_KEY})
        assert not fleet_baselines.refresh_if_due(fleet_engine, now=now + timedelta(hours=2), **due)
    # Due, and free: made, and the empty archive's pass leaves no stale group behind.
    assert fleet_baselines.refresh_if_due(fleet_engine, now=now + timedelta(hours=2), **due)
    with fleet_engine.connect() as connection:
        assert connection.execute(text("SELECT count(*) FROM fleet_baselines")).scalar() == 0


def test_sqlite_has_no_fleet_baselines(tmp_path: object) -> None:
    engine = open_engine(f"sqlite:///{tmp_path}/archive.db")
    try:
        upgrade(engine)
        assert not fleet_baselines.present(engine)
    finally:
        engine.dispose()
