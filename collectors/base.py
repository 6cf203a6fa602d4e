"""The contract between collectors and the agent: field descriptions and typed samples.

A ``Field`` describes one metric family once (name, unit, type, help, label names); a ``Sample`` is
one poll of a collector: a timestamp and the readings that could be taken. Units are converted
before a reading is built, so nothing downstream ever sees MHz, mW, kB or percent.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

FieldKind = Literal["gauge", "counter"]
WindowStat = Literal["mean", "max"]
# The window statistics a field can have (Field.windowed).
BOTH: tuple[WindowStat, ...] = ("mean", "max")
MEAN: tuple[WindowStat, ...] = ("mean",)
PEAK: tuple[WindowStat, ...] = ("max",)

PREFIX = "sustain_"


@dataclass(frozen=True, slots=True)
class Field:
    """One metric family a collector can produce.

    ``stem`` and ``unit`` make the exported name: ``sustain_<stem>_<unit>`` (``_total`` added for
    counters). ``windowed`` names the statistics over the exporter's trailing window that the field
    also gets, as ``..._window_mean_<unit>`` and ``..._window_max_<unit>``, so that what happens
    between two scrapes stays visible: both for the fast quantities (clocks, power, utilization),
    the max where a peak is what matters (temperature against its threshold, a clock-event
    reason that flapped), the mean where the level is (PCIe traffic, GPM ratios). docs/metrics.md,
    "Window statistics", gives the choice and the series it costs per GPU. ``rollup`` fields are
    archived per minute.
    """

    stem: str
    unit: str
    kind: FieldKind
    help: str
    labels: tuple[str, ...] = ()
    windowed: tuple[WindowStat, ...] = ()
    rollup: bool = True

    @property
    def key(self) -> str:
        """The field's name inside the agent and the archive (the metric name without prefix)."""
        base = f"{self.stem}_{self.unit}" if self.unit else self.stem
        return f"{base}_total" if self.kind == "counter" else base

    @property
    def metric_name(self) -> str:
        return PREFIX + self.key

    def window_metric_name(self, stat: WindowStat) -> str:
        unit = f"_{self.unit}" if self.unit else ""
        return f"{PREFIX}{self.stem}_window_{stat}{unit}"


Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Reading:
    """One value of one field. ``labels`` pairs follow the order of ``Field.labels``."""

    field: str
    value: float
    labels: Labels = ()


@dataclass(frozen=True, slots=True)
class Event:
    """Something that happened once and belongs in the archive's event log (a device lost, an
    XID error), as opposed to a reading that is sampled again and again."""

    kind: str
    device: str
    timestamp: float
    message: str
    attributes: tuple[tuple[str, str], ...] = ()
    # Made where the event happens, so that the archive stores it once however often it is sent.
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass(frozen=True, slots=True)
class Sample:
    """One poll of a collector. ``device`` is the device the readings belong to ("host" for the
    host collector, the UUID for a GPU); ``errors`` names the kinds of per-field failures met
    during the poll; ``events`` are what the poll noticed happening. ``foreign_pids`` are the
    processes other than the agent's own running on the device (a GPU's compute processes, as
    its last read of the process list found them): not a metric (a pid is no label), but what
    a running probe yields to."""

    collector: str
    device: str
    timestamp: float
    readings: tuple[Reading, ...]
    errors: tuple[str, ...] = field(default=())
    events: tuple[Event, ...] = field(default=())
    foreign_pids: tuple[int, ...] = field(default=())


class CollectorError(Exception):
    """The collector could read nothing at all during this poll."""


class SourceUnavailable(CollectorError):
    """The source is not installed on this node (no driver): the collector does not apply here.
    Not a fault: the collector says so once in the log itself, counts nothing, and the sampler
    reports the collector absent for ``reason`` (a short name from a fixed set, exported as a
    label) instead of down."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class Collector(Protocol):
    """What the sampler needs from a telemetry source."""

    name: str

    @property
    def fields(self) -> Mapping[str, Field]:
        """Every field this collector can produce, by ``Field.key``."""
        ...

    def collect(self) -> Sequence[Sample]:
        """Poll the source once. Raises ``CollectorError`` only when nothing could be read."""
        ...

    def close(self) -> None:
        """Release whatever the collector holds (file handles, library handles)."""
        ...
