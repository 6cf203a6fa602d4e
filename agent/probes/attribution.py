"""Why a probe slowed down, told from the telemetry captured while it ran (DESIGN.md, analysis
points 5 and 6).

The analysis cuts the iteration series into segments at its change points; this module lays the
device's samples over those segments, summarises each one (share of samples under each
clock-event reason, mean SM clock or CPU frequency, power, temperature, thermal violation time)
and, for a slowdown, compares the steady segment with the fastest earlier one to name a cause.
It also states work per joule from the energy counters.

Pure Python on purpose: it runs inside the daemon, whose memory budget has no room for numpy.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from collectors.base import Reading, Sample

# A reason counts when it holds the clocks during more than this share of a segment's samples:
# one sample caught at a transition must not name a cause.
REASON_SHARE_THRESHOLD = 0.05
# The SM clock (or CPU frequency) must fall by more than this to call a slowdown clock-bound;
# below it, boost clocks wander with temperature and load without explaining anything.
CLOCK_DROP_THRESHOLD = 0.02

SLOWDOWN = "slowdown"
THERMAL_REASONS = ("sw_thermal_slowdown", "hw_thermal_slowdown")
HW_SLOWDOWN = "hw_slowdown"
POWER_BRAKE = "hw_power_brake_slowdown"
POWER_CAP = "sw_power_cap"
HOST = "host"

# A whole CPU package; its sub-zones (package-0/core, package-0/dram) are inside it, psys spans
# the platform, and a repeat through intel-rapl-mmio ("package-0.intel-rapl-mmio:0") measures the
# same package again: summing any of those would count energy twice.
_PACKAGE_ZONE = re.compile(r"package-\d+")


@dataclass(frozen=True, slots=True)
class SegmentTelemetry:
    """What the device did during one segment (first iteration start .. last iteration end).

    Every mean is over the segment's samples that carried the value; ``None`` when none did.
    For the CPU ("host") device ``sm_clock_hertz`` is the mean of every CPU's frequency,
    ``power_watts`` the RAPL package power and ``temperature_celsius`` is always ``None``: hwmon
    names no sensor that is "the CPU" on every vendor (coretemp, k10temp, thermal zones), and a
    wrong one would read as a measurement. ``reason_share`` is empty on the CPU.
    """

    start: float
    end: float
    samples: int
    reason_share: dict[str, float]
    sm_clock_hertz: float | None
    power_watts: float | None
    temperature_celsius: float | None
    thermal_violation_seconds: float | None

    def as_dict(self) -> dict[str, object]:
        return {
            "start": self.start,
            "end": self.end,
            "samples": self.samples,
            "reason_share": dict(self.reason_share),
            "sm_clock_hertz": self.sm_clock_hertz,
            "power_watts": self.power_watts,
            "temperature_celsius": self.temperature_celsius,
            "thermal_violation_seconds": self.thermal_violation_seconds,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SegmentTelemetry:
        """The inverse of ``as_dict`` (an archived analysis read back at start-up)."""
        return cls(
            start=float(data["start"]),
            end=float(data["end"]),
            samples=int(data["samples"]),
            reason_share={str(k): float(v) for k, v in (data.get("reason_share") or {}).items()},
            sm_clock_hertz=_optional_float(data.get("sm_clock_hertz")),
            power_watts=_optional_float(data.get("power_watts")),
            temperature_celsius=_optional_float(data.get("temperature_celsius")),
            thermal_violation_seconds=_optional_float(data.get("thermal_violation_seconds")),
        )


@dataclass(frozen=True, slots=True)
class Attribution:
    """The segments' telemetry and, for a slowdown, its cause.

    ``cause`` is "thermal", "power_brake", "power_cap" (normal under load: reported, never
    alarmed), "clock_unexplained" or "not_clock_bound"; ``None`` when the classification is not a
    slowdown or when the telemetry cannot tell (no samples, no clock readings, no earlier
    segment): a guess would be worse than saying so, and ``reason`` says which. ``compared`` is
    (faster, slower) as indices into ``segments`` when a slowdown was examined.
    """

    segments: tuple[SegmentTelemetry, ...]
    cause: str | None
    work_per_joule: float | None
    reason: str
    compared: tuple[int, int] | None = None

    def as_dict(self) -> dict[str, object]:
        return {
            "segments": [segment.as_dict() for segment in self.segments],
            "cause": self.cause,
            "work_per_joule": self.work_per_joule,
            "reason": self.reason,
            "compared": list(self.compared) if self.compared is not None else None,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Attribution:
        """The inverse of ``as_dict``."""
        compared = data.get("compared")
        return cls(
            segments=tuple(SegmentTelemetry.from_dict(item) for item in data.get("segments") or ()),
            cause=None if data.get("cause") is None else str(data["cause"]),
            work_per_joule=_optional_float(data.get("work_per_joule")),
            reason=str(data.get("reason", "")),
            compared=None if compared is None else (int(compared[0]), int(compared[1])),
        )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(slots=True)
class _Counter:
    """First and last reading of one cumulative series, with their times."""

    first_time: float
    first: float
    last_time: float
    last: float

    def add(self, timestamp: float, value: float) -> None:
        self.last_time, self.last = timestamp, value

    def rate(self) -> float | None:
        """Mean increase per second; ``None`` with fewer than two readings or after a reset."""
        span = self.last_time - self.first_time
        delta = self.last - self.first
        return delta / span if span > 0 and delta >= 0 else None


@dataclass(slots=True)
class _Scan:
    """One pass over a window's samples, collecting what the summaries need."""

    samples: int = 0
    reasons: dict[str, list[int]] = field(default_factory=dict)  # name -> [active, seen]
    clocks: list[float] = field(default_factory=list)
    power: list[float] = field(default_factory=list)
    temperature: list[float] = field(default_factory=list)
    thermal_violation: _Counter | None = None
    energy: dict[str, _Counter] = field(default_factory=dict)  # series -> counter

    def add(self, sample: Sample) -> None:
        self.samples += 1
        for reading in sample.readings:
            self._add_reading(sample.timestamp, reading)

    def _add_reading(self, timestamp: float, reading: Reading) -> None:
        labels = dict(reading.labels)
        name, value = reading.field, reading.value
        if name == "gpu_clock_event_reason_active":
            counts = self.reasons.setdefault(labels.get("reason", ""), [0, 0])
            counts[0] += 1 if value else 0  # a 0/1 gauge
            counts[1] += 1
        elif (name == "gpu_clock_hertz" and labels.get("clock") == "sm") or (
            name == "cpu_frequency_hertz"
        ):
            self.clocks.append(value)
        elif name == "gpu_power_watts":
            self.power.append(value)
        elif name == "gpu_temperature_celsius" and labels.get("sensor") == "gpu":
            self.temperature.append(value)
        elif name == "gpu_violation_seconds_total" and labels.get("policy") == "thermal":
            self.thermal_violation = _extend(self.thermal_violation, timestamp, value)
        elif name == "gpu_energy_joules_total":
            self.energy["gpu"] = _extend(self.energy.get("gpu"), timestamp, value)
        elif name == "rapl_energy_joules_total" and _PACKAGE_ZONE.fullmatch(labels.get("zone", "")):
            zone = labels["zone"]
            self.energy[zone] = _extend(self.energy.get(zone), timestamp, value)

    def energy_watts(self) -> tuple[float, float, float] | None:
        """Summed power of the energy series and the span they cover: (watts, first, last).

        A series read fewer than two times, or reset in between, is left out; with none left
        there is no figure.
        """
        rates = [(c.rate(), c) for c in self.energy.values()]
        usable = [(rate, c) for rate, c in rates if rate is not None]
        if not usable:
            return None
        return (
            sum(rate for rate, _ in usable),
            min(c.first_time for _, c in usable),
            max(c.last_time for _, c in usable),
        )

    def summary(self, start: float, end: float, cpu: bool) -> SegmentTelemetry:
        violation = self.thermal_violation
        thermal = None  # one reading, or a reset, tells no increase
        if violation is not None and violation.rate() is not None:
            thermal = violation.last - violation.first
        if cpu:
            energy = self.energy_watts()
            power = energy[0] if energy is not None else None
        else:
            power = _mean(self.power)
        return SegmentTelemetry(
            start=start,
            end=end,
            samples=self.samples,
            reason_share={name: active / seen for name, (active, seen) in self.reasons.items()},
            sm_clock_hertz=_mean(self.clocks),
            power_watts=power,
            temperature_celsius=None if cpu else _mean(self.temperature),
            thermal_violation_seconds=thermal,
        )


def _extend(counter: _Counter | None, timestamp: float, value: float) -> _Counter:
    if counter is None:
        return _Counter(timestamp, value, timestamp, value)
    counter.add(timestamp, value)
    return counter


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def attribute(  # noqa: PLR0917 - the analysis' outputs, in the order it states them
    telemetry: Sequence[Sample],
    device_key: str,
    iterations: Sequence[tuple[float, float, float]],
    changepoints: Sequence[int],
    classification: str,
    steady_start_index: int | None,
) -> Attribution:
    """Summarise each segment's telemetry and, for a slowdown, name its cause.

    ``telemetry`` may hold any devices and any times: only samples of ``device_key`` ("host" for
    the CPU, else a GPU UUID) with a timestamp inside a segment's [start, end] count, so the
    caller can pass its whole capture. ``iterations`` are (start, end, work) in run order, on the
    same clock as the samples. Raises ``ValueError`` for inputs the analysis never produces (no
    iterations, an index out of range), never for missing telemetry.
    """
    n = len(iterations)
    if n == 0:
        raise ValueError("no iterations to attribute")
    starts = sorted(set(changepoints))
    if any(not 0 < index < n for index in starts):
        raise ValueError(f"change points must lie in 1..{n - 1}: {list(changepoints)}")
    if steady_start_index is not None and not 0 <= steady_start_index < n:
        raise ValueError(f"steady start {steady_start_index} outside 0..{n - 1}")
    bounds = list(zip([0, *starts], [*starts, n], strict=True))

    own = sorted((s for s in telemetry if s.device == device_key), key=lambda s: s.timestamp)
    times = [s.timestamp for s in own]
    cpu = device_key == HOST
    segments = []
    rates = []
    for first, stop in bounds:
        start, end = iterations[first][0], iterations[stop - 1][1]
        scan = _Scan()
        for sample in own[bisect.bisect_left(times, start) : bisect.bisect_right(times, end)]:
            scan.add(sample)
        segments.append(scan.summary(start, end, cpu))
        work = sum(w for _, _, w in iterations[first:stop])
        rates.append(work / (end - start) if end > start else None)

    work_per_joule = _work_per_joule(own, times, iterations)
    if classification != SLOWDOWN:
        reason = f"classification {classification}: no slowdown to explain"
        return Attribution(tuple(segments), None, work_per_joule, reason)

    if steady_start_index is None:
        slower = len(bounds) - 1
    else:
        slower = bisect.bisect_right([first for first, _ in bounds], steady_start_index) - 1
    earlier = [(rate, index) for index, rate in enumerate(rates[:slower]) if rate is not None]
    if not earlier:
        reason = "no earlier segment with a throughput to compare the steady one with"
        return Attribution(tuple(segments), None, work_per_joule, reason)
    faster = max(earlier)[1]
    cause, reason = _cause(segments[faster], segments[slower], device_key)
    return Attribution(tuple(segments), cause, work_per_joule, reason, (faster, slower))


def _cause(
    faster: SegmentTelemetry, slower: SegmentTelemetry, device_key: str
) -> tuple[str | None, str]:
    """A clock-event reason if one held the steady segment, else what the clock itself says.

    Without clock readings on both sides nothing can be said, and the cause stays ``None``
    rather than a confident "not clock-bound".
    """
    if slower.samples == 0:
        return None, f"no telemetry of {device_key} during the steady segment"
    named = _reason_cause(slower)
    if named is not None:
        return named
    before, after = faster.sm_clock_hertz, slower.sm_clock_hertz
    clock = "CPU frequency" if device_key == HOST else "SM clock"
    if before is None or after is None or before <= 0:
        return None, f"no {clock} readings on both sides of the slowdown"
    drop = (before - after) / before
    if drop > CLOCK_DROP_THRESHOLD:
        return "clock_unexplained", f"{clock} fell by {drop:.1%} with no clock-event reason"
    return "not_clock_bound", f"{clock} changed by {-drop:+.1%}: the slowdown is elsewhere"


def _reason_cause(slower: SegmentTelemetry) -> tuple[str, str] | None:
    """The first reason that held the steady segment, in order of how specific it is.

    Thermal comes first because it is what an operator can act on (airflow, fan curves). HW
    slowdown (0x8) counts as thermal unless the power brake (0x80) is active too: NVML raises
    0x8 for both an overheated die and an external brake, and 0x80 is the more specific bit.
    The thermal violation counter covers drivers that report no thermal reason bit; it must
    have risen for more than the reason threshold's share of the segment. Power cap comes last:
    under full load it is the normal state of a GPU, so it explains without alarming.
    """
    share = slower.reason_share
    thermal = [name for name in THERMAL_REASONS if share.get(name, 0.0) > REASON_SHARE_THRESHOLD]
    brake = share.get(POWER_BRAKE, 0.0) > REASON_SHARE_THRESHOLD
    if share.get(HW_SLOWDOWN, 0.0) > REASON_SHARE_THRESHOLD and not brake:
        thermal.append(HW_SLOWDOWN)
    violation = slower.thermal_violation_seconds
    if violation is not None and violation > REASON_SHARE_THRESHOLD * (slower.end - slower.start):
        thermal.append(f"thermal violation counter +{violation:.3g} s")
    if thermal:
        return "thermal", f"{', '.join(thermal)} in the steady segment"
    if brake:
        return "power_brake", f"{POWER_BRAKE} active in the steady segment"
    if share.get(POWER_CAP, 0.0) > REASON_SHARE_THRESHOLD:
        return "power_cap", f"{POWER_CAP} active in the steady segment (normal under load)"
    return None


def _work_per_joule(
    own: Sequence[Sample], times: Sequence[float], iterations: Sequence[tuple[float, float, float]]
) -> float | None:
    """Work per joule over the run, from the GPU energy counter or the RAPL package zones.

    The counters are read only at samples, so the energy is known between the first and last
    sample inside the run; the work is taken over that same span (each iteration in proportion
    to its overlap), rather than the run's whole work set against part of its energy.
    """
    scan = _Scan()
    run_start, run_end = iterations[0][0], iterations[-1][1]
    for sample in own[bisect.bisect_left(times, run_start) : bisect.bisect_right(times, run_end)]:
        scan.add(sample)
    energy = scan.energy_watts()
    if energy is None:
        return None
    watts, first, last = energy
    if watts <= 0:
        return None
    work = 0.0
    for start, end, amount in iterations:
        if end > start:
            overlap = min(end, last) - max(start, first)
            work += amount * max(overlap, 0.0) / (end - start)
        elif first <= start <= last:
            work += amount
    return work / (watts * (last - first))


HOST_CONTENTION = "host_contention"


def coupling_cause(
    solo: SegmentTelemetry | None, node: SegmentTelemetry | None, ratio: float, device_key: str
) -> tuple[str | None, str]:
    """Why a device delivers less with every device of the node working than alone: the causes
    of a slowdown, taken from its steady segment in the node-wide run against the solo run's
    (the GPU that reaches its thermal or power limit only beside its neighbours is the
    finding), or ``host_contention`` where its clock held while the throughput fell (shared
    CPUs, host memory bandwidth, PCIe). ``None`` when neither a reason nor the clocks can tell.
    """
    loss = 1.0 - ratio
    if node is not None and node.samples:
        named = _reason_cause(node)
        if named is not None:
            alone = None if solo is None else _reason_cause(solo)
            where = "in the solo run too" if alone and alone[0] == named[0] else "not when alone"
            return named[0], f"{named[1]} of the node-wide run ({where})"
    before = None if solo is None else solo.sm_clock_hertz
    after = None if node is None else node.sm_clock_hertz
    clock = "CPU frequency" if device_key == HOST else "SM clock"
    if before is None or after is None or before <= 0:
        return None, f"no {clock} readings of both runs: the {loss:.0%} loss is not explained"
    drop = (before - after) / before
    # A clock that fell explains the loss only where it fell by a good part of it.
    if drop > CLOCK_DROP_THRESHOLD and drop >= loss / 2:
        return "clock_unexplained", f"{clock} {drop:.1%} below solo with no clock-event reason"
    return HOST_CONTENTION, (
        f"{clock} held ({-drop:+.1%} against solo) while throughput fell {loss:.0%}: "
        "shared CPUs, host memory or PCIe"
    )
