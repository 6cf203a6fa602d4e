"""Attribution of a slowdown to its cause, from the telemetry of each segment.

The GPU cases run the real NVML collector against the fake driver: GPU 0 works at 1410 MHz with
no clock-event reason, and from the onset either overheats, hits its power cap, or slows down
with its clocks untouched. The iteration series is laid on the scenario clock the samples carry,
its throughput 20% lower from the onset, as the analysis would have cut it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
from conftest import FakeGpus

from agent.probes.attribution import Attribution, SegmentTelemetry, attribute
from collectors.base import Reading, Sample
from collectors.nvml.collector import NvmlCollector

UUID0 = "GPU-00000000-1111-2222-3333-444444444444"
HEADER = f"""
set time_scale 10
device 0 uuid {UUID0}
device 1
at 0 1 sm_clock_mhz 1410 power_mw 600000 reasons 0x0
"""

ONSET = 10.0  # scenario seconds
DURATION = 20.0
ITERATION = 0.1  # scenario seconds per iteration
FAST_POWER, FAST_TEMPERATURE = 600.0, 70.0
FAST_RATE, SLOW_RATE = 10.0, 8.0  # work per scenario second

Scenario = Callable[[str, float], tuple[FakeGpus, NvmlCollector]]


def gpu_scenario(reasons: int, clock_mhz: int, power_w: float, temperature: float) -> str:
    fast = f"at 0 0 sm_clock_mhz 1410 reasons 0x0 power_mw {FAST_POWER * 1000:.0f}"
    slow = f"at {ONSET:g} 0 sm_clock_mhz {clock_mhz} reasons {reasons:#x}"
    slow += f" power_mw {power_w * 1000:.0f}"
    return (
        f"{HEADER}{fast} gpu_temp_c {FAST_TEMPERATURE:.0f}\n{slow} gpu_temp_c {temperature:.0f}\n"
    )


def run_probe(fake: FakeGpus, collector: NvmlCollector) -> list[Sample]:
    """Poll four times a scenario second over the run (0.025 s real at scale 10)."""
    samples: list[Sample] = []
    for step in range(int(DURATION * 4) + 1):
        fake.sleep_until(step / 4)
        samples.extend(collector.collect())
    return samples


def iterations(epoch: float) -> list[tuple[float, float, float]]:
    """One iteration per 0.1 scenario second; work = throughput x duration."""
    count = round(DURATION / ITERATION)
    series = []
    for i in range(count):
        start = epoch + i * ITERATION
        rate = FAST_RATE if i * ITERATION < ONSET else SLOW_RATE
        series.append((start, start + ITERATION, rate * ITERATION))
    return series


ONSET_INDEX = round(ONSET / ITERATION)


def expected_work_per_joule(samples: Sequence[Sample], epoch: float, slow_power: float) -> float:
    """Work over the span the energy counter saw, against the fake's integral of power."""
    times = [
        s.timestamp - epoch
        for s in samples
        if s.device == UUID0 and 0 <= s.timestamp - epoch <= DURATION
    ]
    first, last = min(times), max(times)
    work = FAST_RATE * (ONSET - first) + SLOW_RATE * (last - ONSET)
    energy = FAST_POWER * (ONSET - first) + slow_power * (last - ONSET)
    return work / energy


@dataclass(frozen=True)
class Case:
    """What GPU 0 does from the onset, and the cause that must be found."""

    reasons: int
    clock_mhz: int
    power_w: float
    temperature: float
    cause: str
    reason: str | None


@pytest.mark.parametrize(
    "case",
    [
        Case(0x40, 1100, 450.0, 88.0, "thermal", "hw_thermal_slowdown"),
        Case(0x4, 1300, 700.0, 80.0, "power_cap", "sw_power_cap"),
        Case(0x0, 1410, 600.0, 70.0, "not_clock_bound", None),
    ],
    ids=["hw_thermal", "sw_power_cap", "no_reason_no_clock_drop"],
)
def test_gpu_slowdown_is_attributed_from_the_fake_driver(scenario: Scenario, case: Case) -> None:
    """Acceptance 3 of issue 5."""
    text = gpu_scenario(case.reasons, case.clock_mhz, case.power_w, case.temperature)
    fake, collector = scenario(text, 10.0)
    samples = run_probe(fake, collector)
    series = iterations(fake.epoch)

    result = attribute(samples, UUID0, series, [ONSET_INDEX], "slowdown", ONSET_INDEX)

    assert result.cause == case.cause
    assert result.compared == (0, 1)
    fast, slow = result.segments
    assert fast.start == pytest.approx(fake.epoch)
    assert fast.end == pytest.approx(fake.epoch + ONSET)
    assert slow.end == pytest.approx(fake.epoch + DURATION)
    assert fast.samples >= 30
    assert slow.samples >= 30
    # Every reason the collector reads is there; only the scenario's own one is ever active.
    assert len(fast.reason_share) == len(slow.reason_share) == 9
    assert all(share <= 0.1 for share in fast.reason_share.values())
    for name, share in slow.reason_share.items():
        assert share == (pytest.approx(1.0, abs=0.1) if name == case.reason else 0.0), name
    assert fast.sm_clock_hertz == pytest.approx(1.41e9, rel=0.02)
    assert slow.sm_clock_hertz == pytest.approx(case.clock_mhz * 1e6, rel=0.02)
    assert fast.power_watts == pytest.approx(FAST_POWER, rel=0.03)
    assert slow.power_watts == pytest.approx(case.power_w, rel=0.03)
    assert fast.temperature_celsius == pytest.approx(FAST_TEMPERATURE, abs=1.0)
    assert slow.temperature_celsius == pytest.approx(case.temperature, abs=1.0)
    assert fast.thermal_violation_seconds == pytest.approx(0.0, abs=0.5)
    if case.reasons == 0x40:
        # The fake counts thermal violation time while 0x40 holds: all of the slow segment that
        # the samples span (on a loaded machine a late poll can fall past its end).
        times = [
            sample.timestamp - fake.epoch
            for sample in samples
            if sample.device == UUID0 and ONSET <= sample.timestamp - fake.epoch <= DURATION
        ]
        assert slow.thermal_violation_seconds == pytest.approx(max(times) - min(times), abs=1.0)
    else:
        assert slow.thermal_violation_seconds == 0.0
    expected = expected_work_per_joule(samples, fake.epoch, case.power_w)
    assert result.work_per_joule == pytest.approx(expected, rel=0.02)
    json.dumps(result.as_dict(), allow_nan=False)  # archivable as it is


# Hand-built samples, for the branches the fake driver does not need to show.

SEGMENT = 10.0  # seconds per segment in the hand-built runs
T0 = 1_700_000_000.0


def gpu_sample(
    t: float,
    clock_mhz: float,
    active: Sequence[str] = (),
    *,
    energy_j: float | None = None,
    thermal_s: float = 0.0,
) -> Sample:
    ids = (("device", "0"), ("uuid", UUID0))
    readings = [
        Reading("gpu_clock_hertz", clock_mhz * 1e6, (*ids, ("clock", "sm"))),
        Reading("gpu_clock_hertz", 2.619e9, (*ids, ("clock", "memory"))),
        Reading("gpu_power_watts", 500.0, ids),
        Reading("gpu_temperature_celsius", 70.0, (*ids, ("sensor", "gpu"))),
        Reading("gpu_temperature_celsius", 90.0, (*ids, ("sensor", "memory"))),
        Reading("gpu_violation_seconds_total", thermal_s, (*ids, ("policy", "thermal"))),
        Reading("gpu_violation_seconds_total", 5.0 + t, (*ids, ("policy", "power"))),
    ]
    for name in ("sw_power_cap", "hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"):
        readings.append(
            Reading(
                "gpu_clock_event_reason_active", float(name in active), (*ids, ("reason", name))
            )
        )
    if energy_j is not None:
        readings.append(Reading("gpu_energy_joules_total", energy_j, ids))
    return Sample("nvml", UUID0, T0 + t, tuple(readings))


def two_segments(
    slow: Callable[[float], Sample], fast: Callable[[float], Sample] | None = None
) -> list[Sample]:
    """A sample each second: ``fast`` during the first segment, ``slow`` during the second."""
    before = fast or (lambda t: gpu_sample(t, 1410))
    return [before(t) if t < SEGMENT else slow(t) for t in (s + 0.5 for s in range(20))]


def run() -> list[tuple[float, float, float]]:
    """200 iterations over 20 s, 20% less work each from iteration 100."""
    step = 2 * SEGMENT / 200
    return [(T0 + i * step, T0 + (i + 1) * step, 1.0 if i < 100 else 0.8) for i in range(200)]


def slowdown(samples: Sequence[Sample], device: str = UUID0) -> Attribution:
    return attribute(samples, device, run(), [100], "slowdown", 100)


def test_power_brake_wins_over_the_hw_slowdown_it_raises() -> None:
    samples = two_segments(lambda t: gpu_sample(t, 700, ("hw_slowdown", "hw_power_brake_slowdown")))
    result = slowdown(samples)
    assert result.cause == "power_brake"
    assert result.segments[1].reason_share["hw_power_brake_slowdown"] == 1.0
    assert result.segments[0].reason_share["hw_power_brake_slowdown"] == 0.0


def test_hw_slowdown_alone_is_thermal() -> None:
    assert slowdown(two_segments(lambda t: gpu_sample(t, 700, ("hw_slowdown",)))).cause == "thermal"


def test_thermal_violation_counter_without_a_reason_bit_is_thermal() -> None:
    samples = two_segments(lambda t: gpu_sample(t, 1300, thermal_s=t - SEGMENT))
    result = slowdown(samples)
    assert result.cause == "thermal"
    assert result.segments[1].thermal_violation_seconds == pytest.approx(9.0)
    assert result.segments[0].thermal_violation_seconds == 0.0


def test_a_reason_counts_past_five_percent_of_the_samples() -> None:
    """One sample in ten (10%) under the power cap is enough; none with a flat clock, nothing."""
    samples = two_segments(lambda t: gpu_sample(t, 1410, ("sw_power_cap",) if t < 10.6 else ()))
    assert slowdown(samples).cause == "power_cap"
    assert slowdown(two_segments(lambda t: gpu_sample(t, 1410))).cause == "not_clock_bound"


def test_clock_drop_without_a_reason_is_unexplained() -> None:
    result = slowdown(two_segments(lambda t: gpu_sample(t, 1300)))
    assert result.cause == "clock_unexplained"
    assert result.segments[1].sm_clock_hertz == pytest.approx(1.3e9)
    assert "7.8%" in result.reason


def test_clock_drop_within_two_percent_is_not_clock_bound() -> None:
    assert slowdown(two_segments(lambda t: gpu_sample(t, 1390))).cause == "not_clock_bound"


def test_gpu_work_per_joule_over_the_span_the_counter_saw() -> None:
    """500 W from the first sample at 0.5 s to the last at 19.5 s: 9500 J. The work in that
    span: 9.5 s at 10/s and 9.5 s at 8/s."""
    samples = two_segments(
        lambda t: gpu_sample(t, 1300, energy_j=1000 + 500 * t),
        lambda t: gpu_sample(t, 1410, energy_j=1000 + 500 * t),
    )
    assert slowdown(samples).work_per_joule == pytest.approx((95 + 76) / 9500)


def package_joules(t: float) -> float:
    """One package's energy: 100 W for the first segment, 90 W after."""
    return 100.0 * min(t, SEGMENT) + 90.0 * max(t - SEGMENT, 0.0)


def host_sample(t: float, frequency_hz: float) -> Sample:
    energy = package_joules(t)
    readings = [
        Reading("cpu_utilization_ratio", 1.0),
        *(
            Reading("cpu_frequency_hertz", frequency_hz + cpu * 1e6, (("cpu", str(cpu)),))
            for cpu in range(4)
        ),
        Reading("temperature_celsius", 70.0, (("chip", "coretemp"), ("sensor", "Package id 0"))),
        Reading("rapl_energy_joules_total", 50.0 + energy, (("zone", "package-0"),)),
        Reading("rapl_energy_joules_total", 90.0 + energy, (("zone", "package-1"),)),
        # Inside package-0 or a repeat of it through MMIO: counting them would count twice.
        Reading("rapl_energy_joules_total", 7.0 + 30 * t, (("zone", "package-0/dram"),)),
        Reading(
            "rapl_energy_joules_total", 3.0 + energy, (("zone", "package-0.intel-rapl-mmio:0"),)
        ),
    ]
    return Sample("host", "host", T0 + t, tuple(readings))


def test_cpu_with_a_flat_frequency_is_not_clock_bound() -> None:
    result = slowdown(
        two_segments(lambda t: host_sample(t, 3.4e9), lambda t: host_sample(t, 3.4e9)), "host"
    )
    assert result.cause == "not_clock_bound"
    assert "CPU frequency" in result.reason
    fast, slow = result.segments
    assert fast.samples == slow.samples == 10
    assert fast.sm_clock_hertz == pytest.approx(3.4015e9)  # the mean over all four CPUs
    assert slow.sm_clock_hertz == pytest.approx(3.4015e9)
    assert fast.power_watts == pytest.approx(200.0)  # two packages at 100 W
    assert slow.power_watts == pytest.approx(180.0)
    assert fast.reason_share == {}
    assert fast.temperature_celsius is None
    assert fast.thermal_violation_seconds is None
    # Both packages from 0.5 s to 19.5 s: 2 x (950 + 855) J for 95 + 76 units of work.
    assert result.work_per_joule == pytest.approx((95 + 76) / (2 * (950 + 855)))


def test_cpu_frequency_drop_is_unexplained() -> None:
    samples = two_segments(lambda t: host_sample(t, 3.0e9), lambda t: host_sample(t, 3.4e9))
    assert slowdown(samples, "host").cause == "clock_unexplained"


def test_no_telemetry_at_all_leaves_the_cause_open() -> None:
    """Other devices' samples, or samples outside the run, are not this device's telemetry."""
    elsewhere = [host_sample(t, 3.4e9) for t in (0.5, 15.0)] + [
        gpu_sample(t, 1410) for t in (-5.0, 25.0)
    ]
    for samples in ([], elsewhere):
        result = slowdown(samples)
        assert result.cause is None
        assert result.reason == f"no telemetry of {UUID0} during the steady segment"
        assert result.work_per_joule is None
        assert [s.samples for s in result.segments] == [0, 0]
        assert result.segments[1] == SegmentTelemetry(
            T0 + SEGMENT, T0 + 2 * SEGMENT, 0, {}, None, None, None, None
        )


def test_samples_without_clocks_leave_the_cause_open() -> None:
    """A lost GPU reports only its health: samples, but nothing to judge the clock by."""
    lost = [
        Sample(
            "nvml",
            UUID0,
            T0 + t,
            (Reading("gpu_healthy", 0.0, (("device", "0"), ("uuid", UUID0))),),
        )
        for t in (1.0, 12.0, 15.0)
    ]
    result = slowdown(lost)
    assert result.cause is None
    assert result.segments[1].samples == 2
    assert result.reason == "no SM clock readings on both sides of the slowdown"


def test_other_classifications_fill_the_segments_and_name_no_cause() -> None:
    samples = two_segments(
        lambda t: gpu_sample(t, 1100, ("hw_thermal_slowdown",), energy_j=500 * t),
        lambda t: gpu_sample(t, 1410, energy_j=500 * t),
    )
    for classification in ("flat", "warmup", "no_steady_state", "insufficient"):
        result = attribute(samples, UUID0, run(), [100], classification, None)
        assert result.cause is None
        assert result.compared is None
        assert result.reason == f"classification {classification}: no slowdown to explain"
        assert result.segments[1].reason_share["hw_thermal_slowdown"] == 1.0
        assert result.segments[1].sm_clock_hertz == pytest.approx(1.1e9)
        assert result.work_per_joule is not None


def test_steady_segment_is_compared_with_the_fastest_earlier_one() -> None:
    """Warm-up (slow), peak, then a slowdown: the peak is the reference, not the warm-up.
    Without a steady start the last segment is the steady one."""
    step = 0.1
    rates = [5.0] * 50 + [10.0] * 100 + [8.0] * 50
    series = [(T0 + i * step, T0 + (i + 1) * step, r * step) for i, r in enumerate(rates)]
    samples = [gpu_sample(t, 1410 if t < 15 else 1300) for t in (s + 0.5 for s in range(20))]
    for steady in (150, None, 170):
        result = attribute(samples, UUID0, series, [150, 50], "slowdown", steady)
        assert result.compared == (1, 2)
        assert result.cause == "clock_unexplained"
        assert [s.samples for s in result.segments] == [5, 10, 5]


def test_a_slowdown_with_no_earlier_segment_has_no_cause() -> None:
    result = attribute(two_segments(lambda t: gpu_sample(t, 1100)), UUID0, run(), [], "slowdown", 0)
    assert result.cause is None
    assert result.compared is None
    assert len(result.segments) == 1


@pytest.mark.parametrize(
    ("series", "changepoints", "steady"),
    [([], [], None), (run(), [0], 100), (run(), [200], 100), (run(), [100], 200)],
    ids=["no_iterations", "changepoint_at_0", "changepoint_past_end", "steady_past_end"],
)
def test_inputs_the_analysis_never_produces_are_refused(
    series: list[tuple[float, float, float]], changepoints: list[int], steady: int | None
) -> None:
    with pytest.raises(ValueError, match=r"iterations|change points|steady start"):
        attribute([], UUID0, series, changepoints, "slowdown", steady)
