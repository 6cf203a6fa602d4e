"""What one run plot shows, gathered from a run that just ended, an archived run or a series
file, in one shape (``RunPlot``) that ``agent.plots.run_figure`` draws.

Times are seconds from the start of the run's first iteration. A run that just ended
(``sustain probe --plot``) has its telemetry at 10 Hz; the archive keeps no samples, only the
means of each segment of an analysed run (the attribution), so an archived run's panels are
steps, one level per segment, and say so; a series file has no telemetry at all.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.analysis.trace import RunTrace
from collectors.base import Sample

Span = tuple[float, float, float]  # start, end, share of the time the reason was active
IterationRow = tuple[float, float, float, str | None]  # start, end, work, phase

_PACKAGE_ZONE = re.compile(r"package-\d+")
MHZ = 1e6


@dataclass(frozen=True, slots=True)
class Panel:
    """One telemetry quantity under the throughput, against its limit where one is known."""

    key: str  # the element id's stem: panel-<key>
    label: str  # the y axis: "SM clock (MHz)"
    times: tuple[float, ...]
    values: tuple[float, ...]
    limit: float | None = None
    limit_label: str = ""
    missing: str = ""  # why there are no values, shown in the panel


@dataclass(frozen=True, slots=True)
class RunPlot:
    title: str
    unit: str
    times: tuple[float, ...]  # each analysed iteration's end
    throughput: tuple[float, ...]
    outliers: tuple[int, ...]  # positions in ``times``
    window_times: tuple[float, ...]  # each one-second window's middle
    window_throughput: tuple[float, ...]
    changepoints: tuple[float, ...]
    steady_start: float | None
    peak: float | None
    steady: float | None
    steady_ci: tuple[float, float] | None
    classification: str
    reason: str
    panels: tuple[Panel, ...] = ()
    reasons: Mapping[str, tuple[Span, ...]] = field(default_factory=dict)
    reasons_note: str = ""  # why there is no timeline of clock-event reasons
    reasons_panel: bool = True  # a CPU has no clock-event reasons: no timeline at all
    note: str = ""  # where the telemetry comes from
    # A run with no steady state: what its one-second windows delivered at worst and typically.
    p10: float | None = None
    p50: float | None = None


def build(
    title: str,
    unit: str,
    iterations: Sequence[IterationRow],
    figures: Mapping[str, Any],
    trace: RunTrace,
) -> RunPlot:
    """The throughput part of a run plot. ``figures`` are the analysis' (``changepoints`` and
    ``steady_start_index`` in the run's own iteration numbers); panels are added by the caller."""
    origin = iterations[0][0] if iterations else 0.0
    chosen = trace.positions
    where = {run_index: position for position, run_index in enumerate(chosen)}

    def start_of(index: int) -> float:
        return iterations[index][0] - origin

    steady_index = figures.get("steady_start_index")
    ci = figures.get("steady_ci")
    return RunPlot(
        title=title,
        unit=unit,
        times=tuple(iterations[i][1] - origin for i in chosen),
        throughput=tuple(iterations[i][2] / (iterations[i][1] - iterations[i][0]) for i in chosen),
        outliers=tuple(where[i] for i in trace.outliers if i in where),
        window_times=tuple(t - origin + 0.5 for t in trace.window_starts),
        window_throughput=trace.window_throughput,
        changepoints=tuple(
            start_of(int(i)) for i in figures.get("changepoints") or () if 0 < i < len(iterations)
        ),
        steady_start=None if steady_index is None else start_of(int(steady_index)),
        peak=_number(figures.get("peak_throughput")),
        steady=_number(figures.get("steady_throughput")),
        steady_ci=None if ci is None else (float(ci[0]), float(ci[1])),
        classification=str(figures.get("classification") or "not analysed"),
        reason=str(figures.get("reason") or ""),
        p10=_number(figures.get("p10_throughput")),
        p50=_number(figures.get("p50_throughput")),
    )


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


# Telemetry captured while the run ran (sustain probe --plot)


@dataclass(slots=True)
class _Series:
    times: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    limit: float | None = None

    def add(self, time: float, value: float) -> None:
        self.times.append(time)
        self.values.append(value)


# The GPU readings a panel draws: (field, the value of its distinguishing label) -> (panel,
# whether it is the panel's limit, divisor to the panel's unit).
_GPU_LABEL = {
    "gpu_clock_hertz": "clock",
    "gpu_clock_max_hertz": "clock",
    "gpu_temperature_celsius": "sensor",
    "gpu_temperature_threshold_celsius": "threshold",
}
_GPU_SERIES = {
    ("gpu_clock_hertz", "sm"): ("clock", False, MHZ),
    ("gpu_clock_max_hertz", "sm"): ("clock", True, MHZ),
    ("gpu_temperature_celsius", "gpu"): ("temperature", False, 1.0),
    ("gpu_temperature_threshold_celsius", "slowdown"): ("temperature", True, 1.0),
    ("gpu_power_watts", ""): ("power", False, 1.0),
    ("gpu_power_limit_watts", ""): ("power", True, 1.0),
}


def sample_panels(
    samples: Sequence[Sample], device_key: str, origin: float, end: float
) -> tuple[tuple[Panel, ...], dict[str, tuple[Span, ...]], str]:
    """Panels, reason spans and a note from the samples of ``device_key`` ("host" for the CPU,
    else the GPU's UUID) taken between ``origin`` and ``end`` (a second of margin either side)."""
    own = sorted(
        (s for s in samples if s.device == device_key and origin - 1 <= s.timestamp <= end + 1),
        key=lambda s: s.timestamp,
    )
    if device_key == "host":
        return _cpu_panels(own, origin), {}, "the CPU has no clock-event reasons"
    series = {"clock": _Series(), "temperature": _Series(), "power": _Series()}
    active: dict[str, list[float]] = {}  # reason -> times it was seen active
    seen_reasons: set[str] = set()
    times = [s.timestamp - origin for s in own]
    for sample, time in zip(own, times, strict=True):
        for reading in sample.readings:
            labels = dict(reading.labels)
            if reading.field == "gpu_clock_event_reason_active":
                reason = labels.get("reason", "")
                seen_reasons.add(reason)
                if reading.value:
                    active.setdefault(reason, []).append(time)
                continue
            label = labels.get(_GPU_LABEL.get(reading.field, ""), "")
            target = _GPU_SERIES.get((reading.field, label))
            if target is None:
                continue
            name, is_limit, scale = target
            if is_limit:
                series[name].limit = reading.value / scale
            else:
                series[name].add(time, reading.value / scale)
    clock, temperature, power = series["clock"], series["temperature"], series["power"]
    panels = (
        _panel("sm-clock", "SM clock (MHz)", clock, "max", "no SM clock readings"),
        _panel("temperature", "GPU temperature (°C)", temperature, "slowdown", "no readings"),
        _panel("power", "power (W)", power, "limit", "no power readings"),
    )
    spans = {reason: _spans(moments, times) for reason, moments in sorted(active.items())}
    note = "" if seen_reasons else "no clock-event reasons read"
    if seen_reasons and not spans:
        note = "no clock-event reason was active"
    return panels, spans, note


def _cpu_panels(own: Sequence[Sample], origin: float) -> tuple[Panel, ...]:
    frequency, package = _Series(), _Series()
    previous: tuple[float, float] | None = None  # time, summed package energy
    for sample in own:
        time = sample.timestamp - origin
        clocks: list[float] = []
        energy: list[float] = []
        for reading in sample.readings:
            if reading.field == "cpu_frequency_hertz":
                clocks.append(reading.value)
            elif reading.field == "cpu_frequency_max_hertz":
                frequency.limit = max(frequency.limit or 0.0, reading.value / MHZ)
            elif reading.field == "rapl_energy_joules_total" and _PACKAGE_ZONE.fullmatch(
                dict(reading.labels).get("zone", "")
            ):
                energy.append(reading.value)
        if clocks:
            frequency.add(time, sum(clocks) / len(clocks) / MHZ)
        if energy:
            total = sum(energy)
            if previous is not None and time > previous[0] and total >= previous[1]:
                package.add(time, (total - previous[1]) / (time - previous[0]))
            previous = (time, total)
    return (
        _panel(
            "cpu-frequency",
            "CPU frequency, mean of CPUs (MHz)",
            frequency,
            "max",
            "no CPU frequency readings",
        ),
        _panel(
            "package-power",
            "package power (W)",
            package,
            "",
            "no package power: RAPL is not readable here",
        ),
    )


def _panel(key: str, label: str, series: _Series, limit_label: str, missing: str) -> Panel:
    return Panel(
        key,
        label,
        tuple(series.times),
        tuple(series.values),
        series.limit,
        limit_label if series.limit is not None else "",
        "" if series.values else missing,
    )


def _spans(moments: Sequence[float], times: Sequence[float]) -> tuple[Span, ...]:
    """Each active reading holds until the next sample; neighbouring ones merge."""
    following = dict(zip(times, [*times[1:], times[-1] if times else 0.0], strict=True))
    spans: list[Span] = []
    for moment in moments:
        until = max(following.get(moment, moment), moment)
        if spans and spans[-1][1] >= moment:
            spans[-1] = (spans[-1][0], until, 1.0)
        else:
            spans.append((moment, until, 1.0))
    return tuple(spans)


# An archived run: the segments of its attribution


def segment_panels(
    segments: Sequence[Mapping[str, Any]], device_key: str, origin: float
) -> tuple[tuple[Panel, ...], dict[str, tuple[Span, ...]], str]:
    """Steps: one level per segment (``Attribution.as_dict()["segments"]``), times on the
    iterations' clock; reasons as spans over the segments where they held, with their share."""
    cpu = device_key == "host"
    series = {"clock": _Series(), "temperature": _Series(), "power": _Series()}
    spans: dict[str, list[Span]] = {}
    for segment in segments:
        start, end = float(segment["start"]) - origin, float(segment["end"]) - origin
        for name, key, scale in (
            ("clock", "sm_clock_hertz", MHZ),
            ("temperature", "temperature_celsius", 1.0),
            ("power", "power_watts", 1.0),
        ):
            value = segment.get(key)
            if value is not None:
                series[name].add(start, float(value) / scale)
                series[name].add(end, float(value) / scale)
        for reason, share in sorted((segment.get("reason_share") or {}).items()):
            if share > 0:
                spans.setdefault(reason, []).append((start, end, float(share)))
    panels: tuple[Panel, ...]
    if cpu:
        panels = (
            _panel("cpu-frequency", "CPU frequency (MHz)", series["clock"], "", "no readings"),
            _panel("package-power", "package power (W)", series["power"], "", "no RAPL readings"),
        )
        return panels, {}, "the CPU has no clock-event reasons"
    panels = (
        _panel("sm-clock", "SM clock (MHz)", series["clock"], "", "no SM clock readings"),
        _panel("temperature", "GPU temperature (°C)", series["temperature"], "", "no readings"),
        _panel("power", "power (W)", series["power"], "", "no power readings"),
    )
    note = "" if spans else "no clock-event reason held any segment"
    return panels, {name: tuple(items) for name, items in spans.items()}, note
