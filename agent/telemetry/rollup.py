"""Per-period telemetry rollups: what the archive keeps of the live samples.

Each sampler loop feeds every reading into an accumulator for the current period (one minute by
default). When a period is over, its accumulators become ``RollupRow``s waiting for the archive
job. Gauges are summarised as they are; counters are summarised as their per-second rate between
consecutive samples (an energy counter in joules becomes watts), since the mean of a counter means
nothing. Only whole periods become rows: the periods in which the agent started and stopped are
not written, since a row for them would claim a full period it did not observe.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from collectors.base import Field, Labels, Sample

RollupKind = Literal["gauge", "rate"]


@dataclass(frozen=True, slots=True)
class RollupRow:
    """Summary of one series over one period. ``labels`` is canonical text: ``cpu=0,zone=dram``."""

    collector: str
    device: str
    field: str
    labels: str
    kind: RollupKind
    period_start: float
    period_seconds: int
    mean: float
    min: float
    max: float
    p95: float
    sample_count: int


def labels_text(labels: Labels) -> str:
    return ",".join(f"{name}={value}" for name, value in labels)


def p95(values: list[float]) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=20, method="inclusive")[-1]


SeriesKey = tuple[str, str, str, Labels]  # collector, device, field key, labels


class _Accumulator:
    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: list[float] = []


class RollupBuilder:
    """Turns samples into whole-period rollup rows, thread-safe.

    ``add`` is called from the sampler loops; ``close_periods`` and ``take`` from the archive job.
    """

    def __init__(
        self, fields: dict[str, dict[str, Field]], period_seconds: int, started_at: float
    ) -> None:
        self._fields = fields
        self.period_seconds = period_seconds
        self._started_at = started_at
        self._lock = threading.Lock()
        self._open: dict[tuple[SeriesKey, int], _Accumulator] = {}
        self._last_counter: dict[SeriesKey, tuple[float, float]] = {}
        self._pending: list[RollupRow] = []

    def _period_of(self, timestamp: float) -> int:
        return int(timestamp // self.period_seconds) * self.period_seconds

    def add(self, sample: Sample) -> None:
        fields = self._fields.get(sample.collector, {})
        period = self._period_of(sample.timestamp)
        with self._lock:
            for reading in sample.readings:
                field = fields.get(reading.field)
                if field is None or not field.rollup or not math.isfinite(reading.value):
                    continue
                key = (sample.collector, sample.device, reading.field, reading.labels)
                value = reading.value
                if field.kind == "counter":
                    last = self._last_counter.get(key)
                    self._last_counter[key] = (sample.timestamp, value)
                    if last is None or sample.timestamp <= last[0] or value < last[1]:
                        continue  # first sight, clock step or counter reset: no rate yet
                    value = (value - last[1]) / (sample.timestamp - last[0])
                accumulator = self._open.get((key, period))
                if accumulator is None:
                    accumulator = self._open[(key, period)] = _Accumulator()
                accumulator.values.append(value)

    def close_periods(self, now: float) -> int:
        """Move every period that ended before ``now`` to the pending rows; return how many
        series-periods were closed (including a partial first period, which is dropped)."""
        current = self._period_of(now)
        with self._lock:
            done = [item for item in self._open if item[1] < current]
            for item in sorted(done, key=lambda entry: entry[1]):
                (collector, device, field_key, labels), period = item
                values = self._open.pop(item).values
                if period < self._started_at:
                    continue  # the agent started during this period: it saw only part of it
                kind: RollupKind = (
                    "rate" if self._fields[collector][field_key].kind == "counter" else "gauge"
                )
                self._pending.append(
                    RollupRow(
                        collector=collector,
                        device=device,
                        field=field_key,
                        labels=labels_text(labels),
                        kind=kind,
                        period_start=float(period),
                        period_seconds=self.period_seconds,
                        mean=math.fsum(values) / len(values),
                        min=min(values),
                        max=max(values),
                        p95=p95(values),
                        sample_count=len(values),
                    )
                )
            return len(done)

    def take(self) -> list[RollupRow]:
        """The pending rows; hand them back with ``give_back`` if the write fails."""
        with self._lock:
            rows, self._pending = self._pending, []
            return rows

    def give_back(self, rows: Iterable[RollupRow]) -> None:
        with self._lock:
            self._pending[:0] = list(rows)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)
