"""Bounded in-memory telemetry: one ring buffer per device and field, and the latest poll.

The exporter and the probe scheduler (busy checks, the devices it can probe) read from here, so a
collector is polled once no matter how many consumers there are. Every buffer has a fixed
capacity, so the agent's memory does not grow with uptime; two ``array('d')`` per series cost 16
bytes a sample.
"""

from __future__ import annotations

import math
import threading
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

from collectors.base import Labels, Sample

SeriesKey = tuple[str, str, str, Labels]  # collector, device, field key, labels


@dataclass(frozen=True, slots=True)
class WindowStats:
    mean: float
    max: float
    count: int


class RingBuffer:
    """Fixed-capacity (timestamp, value) history; the oldest entry is overwritten first."""

    __slots__ = ("_next", "_size", "capacity", "times", "values")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.times = array("d", bytes(8 * capacity))
        self.values = array("d", bytes(8 * capacity))
        self._next = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def append(self, timestamp: float, value: float) -> None:
        self.times[self._next] = timestamp
        self.values[self._next] = value
        self._next = (self._next + 1) % self.capacity
        self._size = min(self._size + 1, self.capacity)

    def newest_first(self) -> Iterator[tuple[float, float]]:
        index = self._next
        for _ in range(self._size):
            index = (index - 1) % self.capacity
            yield self.times[index], self.values[index]

    def window(self, since: float) -> WindowStats | None:
        """Mean and max of the finite values with timestamp >= ``since``; None if there are none.

        Timestamps are appended in order, so the window's start is found by bisection and its
        values are summed as array slices in C: a scrape computes hundreds of these."""
        size = self._size
        capacity = self.capacity
        start = (self._next - size) % capacity  # the oldest entry
        times = self.times
        low, high = 0, size
        while low < high:  # the first entry at or after ``since``
            middle = (low + high) // 2
            if times[(start + middle) % capacity] < since:
                low = middle + 1
            else:
                high = middle
        count = size - low
        if count == 0:
            return None
        first = (start + low) % capacity
        end = first + count
        values = self.values
        chunk = values[first:end] if end <= capacity else values[first:] + values[: end - capacity]
        total = math.fsum(chunk)
        if math.isfinite(total):
            return WindowStats(mean=total / count, max=max(chunk), count=count)
        finite = [value for value in chunk if math.isfinite(value)]  # a NaN or inf reading
        if not finite:
            return None
        return WindowStats(mean=math.fsum(finite) / len(finite), max=max(finite), count=len(finite))


class TelemetryStore:
    """Ring buffers for every series seen, plus each collector's latest poll per device.

    Only the series of the latest poll are exported, so a sensor or device that disappears stops
    being exported at once instead of lingering as a stale value.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._buffers: dict[SeriesKey, RingBuffer] = {}
        self._latest: dict[tuple[str, str], Sample] = {}

    def record(self, sample: Sample) -> None:
        with self._lock:
            self._latest[(sample.collector, sample.device)] = sample
            for reading in sample.readings:
                key = (sample.collector, sample.device, reading.field, reading.labels)
                buffer = self._buffers.get(key)
                if buffer is None:
                    buffer = self._buffers[key] = RingBuffer(self.capacity)
                buffer.append(sample.timestamp, reading.value)

    def latest(self) -> list[Sample]:
        with self._lock:
            return list(self._latest.values())

    def window(self, key: SeriesKey, since: float) -> WindowStats | None:
        with self._lock:
            buffer = self._buffers.get(key)
            return None if buffer is None else buffer.window(since)

    def windows(self, keys: list[SeriesKey], since: float) -> list[WindowStats | None]:
        """``window`` of each key, under one acquisition of the lock."""
        with self._lock:
            buffers = [self._buffers.get(key) for key in keys]
            return [None if buffer is None else buffer.window(since) for buffer in buffers]

    def points(self, key: SeriesKey, since: float) -> list[tuple[float, float]]:
        """The (timestamp, value) pairs of one series from ``since`` on, oldest first."""
        with self._lock:
            buffer = self._buffers.get(key)
            if buffer is None:
                return []
            found = []
            for timestamp, value in buffer.newest_first():
                if timestamp < since:
                    break
                found.append((timestamp, value))
        found.reverse()
        return found
