"""Ring buffers, the telemetry store, rollup periods and the sampler loop's timing and isolation.

The scripted collector below stands in for a collector *bug* (an exception, a slow poll): that is
the agent's own behaviour under test, not hardware, so no real source can produce it on demand.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import pytest

from agent.telemetry.rollup import RollupBuilder, p95
from agent.telemetry.sampler import SamplerLoop
from agent.telemetry.store import RingBuffer, TelemetryStore
from collectors.base import BOTH, CollectorError, Field, Reading, Sample, SourceUnavailable

GAUGE = Field("thing", "ratio", "gauge", "A test gauge.", windowed=BOTH)
COUNTER = Field("energy", "joules", "counter", "A test counter.", labels=("zone",))
CATALOGUE = {"scripted": {GAUGE.key: GAUGE, COUNTER.key: COUNTER}}


class ScriptedCollector:
    """Plays back a list of outcomes: a value, an exception to raise, a delay in seconds, or an
    event to hang on until it is set (a minute at the most)."""

    name = "scripted"

    def __init__(
        self, script: Sequence[float | Exception | tuple[str, float] | threading.Event]
    ) -> None:
        self._script = list(script)
        self.polls: list[float] = []
        self.done = threading.Event()

    @property
    def fields(self) -> Mapping[str, Field]:
        return CATALOGUE["scripted"]

    def collect(self) -> Sequence[Sample]:
        self.polls.append(time.monotonic())
        if not self._script:
            self.done.set()
            return [Sample("scripted", "dev0", time.time(), (Reading(GAUGE.key, 0.0),))]
        step = self._script.pop(0)
        if isinstance(step, Exception):
            raise step
        if isinstance(step, tuple):
            time.sleep(step[1])
            step = 0.0
        if isinstance(step, threading.Event):
            step.wait(60)
            step = 0.0
        return [Sample("scripted", "dev0", time.time(), (Reading(GAUGE.key, step),))]

    def close(self) -> None:
        return


def test_ring_buffer_is_bounded_and_keeps_the_newest() -> None:
    buffer = RingBuffer(4)
    for i in range(10):
        buffer.append(float(i), float(i * 10))
    assert len(buffer) == 4
    assert list(buffer.newest_first()) == [(9.0, 90.0), (8.0, 80.0), (7.0, 70.0), (6.0, 60.0)]


def test_window_mean_and_max_keep_a_short_peak() -> None:
    buffer = RingBuffer(100)
    for i in range(30):
        buffer.append(1000.0 + i, 0.9 if i == 25 else 0.1)
    stats = buffer.window(since=1015.0)
    assert stats is not None
    assert stats.count == 15
    assert stats.max == 0.9
    assert stats.mean == pytest.approx((14 * 0.1 + 0.9) / 15)
    assert buffer.window(since=2000.0) is None


@pytest.mark.parametrize("capacity", [7, 10, 64])
def test_window_is_the_same_as_a_scan_whatever_the_ring_wrap(capacity: int) -> None:
    """The window is found by bisection over the ring (issue 17, scrape cost): it must match a
    plain scan of the newest entries for every start, across the wrap, with NaN and inf kept out."""
    buffer = RingBuffer(capacity)
    entries = []
    for i in range(23):
        value = math.nan if i == 17 else math.inf if i == 19 else float((i * 7) % 11)
        buffer.append(100.0 + i, value)
        entries.append((100.0 + i, value))
    kept = entries[-capacity:]
    for since in [99.0, *(100.0 + i + offset for i in range(23) for offset in (0.0, 0.5)), 200.0]:
        finite = [v for t, v in kept if t >= since and math.isfinite(v)]
        stats = buffer.window(since)
        if not finite:
            assert stats is None, since
            continue
        assert stats is not None, since
        assert (stats.count, stats.max) == (len(finite), max(finite)), since
        assert stats.mean == pytest.approx(sum(finite) / len(finite)), since


def test_store_exports_only_the_latest_poll_per_device() -> None:
    store = TelemetryStore(16)
    store.record(Sample("c", "dev0", 1.0, (Reading("a", 1.0), Reading("b", 2.0))))
    store.record(Sample("c", "dev0", 2.0, (Reading("a", 3.0),)))
    store.record(Sample("c", "dev1", 2.0, (Reading("a", 5.0),)))
    latest = {sample.device: sample for sample in store.latest()}
    assert [r.field for r in latest["dev0"].readings] == ["a"]  # "b" vanished: not exported
    stats = store.window(("c", "dev0", "a", ()), since=0.0)
    assert stats is not None
    assert (stats.mean, stats.count) == (2.0, 2)


def test_rollup_rows_cover_whole_periods_only() -> None:
    builder = RollupBuilder(CATALOGUE, period_seconds=60, started_at=6000.0)
    base = 6000.0  # a period boundary
    for second in range(0, 150):
        builder.add(Sample("scripted", "dev0", base + second, (Reading(GAUGE.key, second % 60),)))
    assert builder.close_periods(now=base + 150) == 2  # the third period is still open
    rows = builder.take()
    assert [row.period_start for row in rows] == [base, base + 60]
    first = rows[0]
    assert (first.min, first.max, first.sample_count, first.kind) == (0, 59, 60, "gauge")
    assert first.mean == pytest.approx(29.5)
    assert first.p95 == pytest.approx(p95([float(v) for v in range(60)]))
    assert builder.pending == 0


def test_rollup_drops_the_period_the_agent_started_in() -> None:
    builder = RollupBuilder(CATALOGUE, period_seconds=60, started_at=6030.0)
    for second in range(30, 130):
        builder.add(Sample("scripted", "dev0", 6000.0 + second, (Reading(GAUGE.key, 1.0),)))
    builder.close_periods(now=6130.0)
    assert [row.period_start for row in builder.take()] == [6060.0]


def test_counter_rollup_is_a_rate_and_survives_a_reset() -> None:
    builder = RollupBuilder(CATALOGUE, period_seconds=60, started_at=6000.0)
    zone = (("zone", "package-0"),)
    values = [100.0, 150.0, 200.0, 10.0, 60.0]  # 50 J/s, then a reset, then 50 J/s again
    for i, value in enumerate(values):
        builder.add(Sample("scripted", "dev0", 6000.0 + i, (Reading(COUNTER.key, value, zone),)))
    builder.close_periods(now=6060.0)
    (row,) = builder.take()
    assert (row.kind, row.labels, row.sample_count) == ("rate", "zone=package-0", 3)
    assert row.mean == row.min == row.max == 50.0


def test_rollup_skips_non_finite_values_and_gives_back_rows() -> None:
    builder = RollupBuilder(CATALOGUE, period_seconds=60, started_at=6000.0)
    builder.add(Sample("scripted", "d", 6001.0, (Reading(GAUGE.key, math.nan),)))
    builder.add(Sample("scripted", "d", 6002.0, (Reading(GAUGE.key, 0.5),)))
    builder.close_periods(now=6061.0)
    rows = builder.take()
    assert [row.sample_count for row in rows] == [1]
    builder.give_back(rows)
    assert builder.pending == 1


def test_loop_polls_on_a_fixed_grid() -> None:
    """Deadline-based: the n-th poll is due at start + n * interval, whatever each poll costs
    (60% of the interval here), so there is no accumulated drift: a loop that slept an interval
    after each poll would be 12 polls' cost (0.72 s) late by the 12th. A loaded machine makes a
    single poll late (bounded here by half a second), or skips deadlines (counted), never
    both."""
    interval, cost = 0.1, 0.06
    collector = ScriptedCollector([("slow", cost)] * 12)
    loop = SamplerLoop(collector, interval, sinks=(), stall_seconds=5)
    loop.start()
    assert collector.done.wait(60)
    loop.request_stop()
    assert loop.join(30)
    polls = collector.polls[:13]
    gaps = [b - a for a, b in itertools.pairwise(polls)]
    elapsed = polls[12] - polls[0]
    missed = loop.status().missed_polls
    assert elapsed <= (12 + missed) * interval + 0.5, (elapsed, missed, gaps)
    assert all(gap >= cost for gap in gaps)  # one poll at a time, each after the last ended


def test_loop_isolates_and_counts_failures_and_overruns() -> None:
    seen: list[Sample] = []
    script: list[float | Exception | tuple[str, float]] = [
        0.5,
        CollectorError("nothing readable"),
        RuntimeError("collector bug"),
        ("slow", 0.35),  # overruns 0.1 s slots: deadlines are skipped, not burst-polled
        0.7,
    ]
    collector = ScriptedCollector(script)
    loop = SamplerLoop(collector, 0.1, sinks=(seen.append,), stall_seconds=5)
    loop.start()
    assert collector.done.wait(60)
    loop.request_stop()
    assert loop.join(30)
    status = loop.status()
    assert status.errors == {"collect": 1, "RuntimeError": 1}
    assert status.missed_polls >= 2
    assert status.up
    assert [s.readings[0].value for s in seen[:3]] == [0.5, 0.0, 0.7]


def test_an_absent_source_counts_no_error_and_a_failing_one_does() -> None:
    """SourceUnavailable (no driver on this node) makes the collector absent, not down: nothing
    is counted. A CollectorError afterwards is a fault again; a good poll clears both."""
    absent = SourceUnavailable("NVML unavailable: Driver Not Loaded", "driver_not_loaded")
    collector = ScriptedCollector([absent, absent, CollectorError("broken"), 0.5])
    loop = SamplerLoop(collector, 1.0, sinks=(), stall_seconds=5)
    states = []
    for _ in range(4):
        loop.poll_once()
        status = loop.status()
        states.append((status.up, status.absent, dict(status.errors)))
    assert states == [
        (False, "driver_not_loaded", {}),
        (False, "driver_not_loaded", {}),
        (False, None, {"collect": 1}),
        (True, None, {"collect": 1}),
    ]


def test_a_failing_sink_does_not_stop_sampling() -> None:
    def broken_sink(sample: Sample) -> None:
        raise ValueError("sink bug")

    collector = ScriptedCollector([0.1, 0.2, 0.3])
    loop = SamplerLoop(collector, 0.02, sinks=(broken_sink,), stall_seconds=5)
    loop.start()
    assert collector.done.wait(60)
    loop.request_stop()
    loop.join(30)
    assert loop.status().errors["sink"] >= 3


def test_a_hung_poll_is_reported_as_stalled() -> None:
    """A poll that hangs (until released here, not for a fixed time a loaded machine could
    outlast before the check) is reported as stalled after 0.3 s, and no longer once the poll
    returns."""
    release = threading.Event()
    collector = ScriptedCollector([0.1, release])
    loop = SamplerLoop(collector, 0.05, sinks=(), stall_seconds=0.3)
    loop.start()
    try:
        wait_until(lambda: len(collector.polls) == 2, "into the hanging poll")
        wait_until(lambda: loop.status().stalled, "reported as stalled")
    finally:
        release.set()
    assert collector.done.wait(60)
    wait_until(lambda: not loop.status().stalled, "stalled no longer")
    loop.request_stop()
    loop.join(30)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {timeout} s"
        time.sleep(0.01)
