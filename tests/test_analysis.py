"""Steady-state analysis against a labelled synthetic corpus, property tests and edge cases.

The corpus follows the acceptance criteria of issue 5: flat series; warm-up as a step, a ramp and
two steps; slowdowns at 20-60% of the run; no steady state as an oscillation, a late step (in
the last 10%) or a steady drift; lengths 150-3000; noise of 0.3-2% with Student-t (df 3) tails
and 1% outliers. Seeds are fixed, so the measured figures are the same on every run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from agent.analysis import (
    Classification,
    InvalidSeriesError,
    SteadyStateResult,
    analyze,
    analyze_durations,
    latency_percentiles,
)
from agent.analysis.changepoints import pelt_mean
from agent.analysis.figures import MAX_TEXTURE_PERIOD
from agent.analysis.input import SeriesInputError, analyze_file, read_series
from agent.analysis.mser import mser5
from agent.analysis.outliers import inlier_mask
from agent.analysis.summary import render_summary

C = Classification
# A cycle of up to MAX_TEXTURE_PERIOD iterations is the workload's texture (two kernels
# alternating, a pause every few iterations), not an oscillation (issue 23).
OSCILLATION_MIN_PERIOD = MAX_TEXTURE_PERIOD + 2.0
KINDS_PER_CLASS = {
    "flat": 30,
    "warmup_step": 25,
    "warmup_ramp": 25,
    "warmup_two_steps": 25,
    "slowdown": 30,
    "oscillation": 22,
    "late_step": 22,
    "drift": 22,
}
LABELS = {
    "flat": C.FLAT,
    "warmup_step": C.WARMUP,
    "warmup_ramp": C.WARMUP,
    "warmup_two_steps": C.WARMUP,
    "slowdown": C.SLOWDOWN,
    "oscillation": C.NO_STEADY_STATE,
    "late_step": C.NO_STEADY_STATE,
    "drift": C.NO_STEADY_STATE,
}


@dataclass(frozen=True, slots=True)
class Case:
    kind: str
    seed: int
    series: NDArray[np.float64]
    label: Classification
    start: int | None
    steady: float | None


def heavy_tails(rng: np.random.Generator, n: int) -> NDArray[np.float64]:
    """Student t (df 3) with unit variance, clipped so no throughput can turn negative."""
    draws: NDArray[np.float64] = np.clip(rng.standard_t(3, n), -15.0, 15.0) / math.sqrt(3.0)
    return draws


def make_case(kind: str, seed: int) -> Case:
    rng = np.random.default_rng(seed)
    n = int(math.exp(rng.uniform(math.log(150), math.log(3000))))
    level = 10.0 ** rng.uniform(-1.0, 3.0)
    sigma = rng.uniform(0.003, 0.02)
    base = np.ones(n)
    start: int | None = 0
    i = np.arange(n, dtype=np.float64)
    if kind == "warmup_step":
        start = max(10, int(rng.uniform(0.05, 0.4) * n))
        base[:start] = 1.0 - rng.uniform(0.08, 0.4)
    elif kind == "warmup_ramp":
        start = max(10, int(rng.uniform(0.05, 0.2) * n))
        base[:start] = np.linspace(1.0 - rng.uniform(0.12, 0.3), 1.0, start, endpoint=False)
    elif kind == "warmup_two_steps":
        first = max(8, int(rng.uniform(0.03, 0.15) * n))
        start = max(first + 10, int(rng.uniform(0.2, 0.4) * n))
        base[:first] = 1.0 - rng.uniform(0.15, 0.35)
        base[first:start] = 1.0 - rng.uniform(0.06, 0.12)
    elif kind == "slowdown":
        start = int(rng.uniform(0.2, 0.6) * n)
        base[start:] = 1.0 - rng.uniform(0.06, 0.3)
    elif kind == "oscillation":
        start = None
        period = max(OSCILLATION_MIN_PERIOD, rng.uniform(n / 40, n / 6))
        wave = np.sin(2 * np.pi * i / period + rng.uniform(0, 2 * np.pi))
        if rng.random() < 0.5:
            wave = np.sign(wave)
        base = 1.0 + rng.uniform(0.04, 0.12) * wave
    elif kind == "late_step":
        start = None
        at = int(rng.uniform(0.9, 0.95) * n)
        base[at:] = 1.0 + rng.choice([-1.0, 1.0]) * rng.uniform(0.06, 0.2)
    elif kind == "drift":
        start = None
        base = 1.0 + rng.choice([-1.0, 1.0]) * rng.uniform(0.08, 0.25) * i / n
    noise = 1.0 + sigma * heavy_tails(rng, n)
    series = level * base * noise
    spikes = rng.random(n) < 0.01
    factors = np.where(rng.random(n) < 0.7, rng.uniform(0.3, 0.7, n), rng.uniform(1.3, 1.8, n))
    series[spikes] *= factors[spikes]
    steady = None if start is None else level * float(base[-1])
    return Case(kind, seed, series, LABELS[kind], start, steady)


# The corpus is analysed once per worker process; the four tests that score it share a worker
# (the xdist group), so that the analysis runs once, not four times, in a parallel run.
@cache
def corpus() -> tuple[tuple[Case, SteadyStateResult], ...]:
    cases = []
    seed = 1000
    for kind, count in KINDS_PER_CLASS.items():
        for _ in range(count):
            case = make_case(kind, seed)
            cases.append((case, analyze(case.series)))
            seed += 1
    return tuple(cases)


@pytest.mark.xdist_group("analysis-corpus")
def test_corpus_classification_accuracy() -> None:
    results = corpus()
    wrong = [
        (c.kind, c.seed, c.series.size, r.classification.value, r.reason)
        for c, r in results
        if r.classification != c.label
    ]
    accuracy = 1.0 - len(wrong) / len(results)
    print(f"\nclassification accuracy {accuracy:.1%} over {len(results)} series")
    for line in wrong:
        print("  misclassified:", line)
    assert accuracy >= 0.95


@pytest.mark.xdist_group("analysis-corpus")
def test_corpus_steady_start_within_5_percent() -> None:
    scored = [(c, r) for c, r in corpus() if c.label in (C.WARMUP, C.SLOWDOWN)]
    assert len(scored) >= 100
    hits = [
        r.steady_start_index is not None
        and c.start is not None
        and abs(r.steady_start_index - c.start) <= 0.05 * c.series.size
        for c, r in scored
    ]
    share = sum(hits) / len(hits)
    print(f"\nsteady start within 5% of n: {share:.1%} of {len(hits)} warm-up/slowdown series")
    assert share >= 0.90


@pytest.mark.xdist_group("analysis-corpus")
def test_corpus_steady_value_within_1_percent() -> None:
    scored = [(c, r) for c, r in corpus() if c.steady is not None]
    hits = [
        r.steady_throughput is not None
        and c.steady is not None
        and abs(r.steady_throughput / c.steady - 1.0) <= 0.01
        for c, r in scored
    ]
    share = sum(hits) / len(hits)
    print(f"\nsteady value within 1%: {share:.1%} of {len(hits)} series with a steady state")
    assert share >= 0.90


@pytest.mark.xdist_group("analysis-corpus")
def test_corpus_figures_are_consistent() -> None:
    for case, result in corpus():
        assert result.n == case.series.size
        assert result.peak_throughput is not None
        assert list(result.changepoints) == sorted(set(result.changepoints))
        assert all(0 < p < result.n for p in result.changepoints)
        if result.has_steady_state:
            assert result.steady_throughput is not None
            assert result.steady_ci is not None
            assert result.sustained_ratio is not None
            low, high = result.steady_ci
            assert low <= result.steady_throughput <= high
            assert result.steady_start_index is not None
            assert result.steady_start_index <= 0.75 * result.n
            assert result.sustained_ratio <= 1.0 + 1e-9
        else:
            assert result.steady_throughput is None
            assert result.steady_start_index is None


def noise_series(seed: int, n: int, sigma: float) -> NDArray[np.float64]:
    rng = np.random.default_rng(seed)
    return 50.0 * (1.0 + sigma * heavy_tails(rng, n))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    kind=st.sampled_from(sorted(KINDS_PER_CLASS)),
    factor=st.floats(1e-6, 1e6, allow_nan=False, allow_infinity=False),
)
def test_scaling_scales_figures_and_keeps_classification(
    seed: int, kind: str, factor: float
) -> None:
    series = make_case(kind, seed).series
    plain = analyze(series)
    scaled = analyze(series * factor)
    assert scaled.classification == plain.classification
    assert scaled.steady_start_index == plain.steady_start_index
    assert plain.peak_throughput is not None
    assert scaled.peak_throughput == pytest.approx(plain.peak_throughput * factor, rel=1e-9)
    if plain.steady_throughput is None:
        assert scaled.steady_throughput is None
    else:
        assert scaled.steady_throughput == pytest.approx(plain.steady_throughput * factor, rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(30, 2000),
    sigma=st.floats(0.001, 0.03),
)
def test_noise_only_never_reports_a_slowdown(seed: int, n: int, sigma: float) -> None:
    result = analyze(noise_series(seed, n, sigma))
    assert result.classification != C.SLOWDOWN, result.reason


def test_too_short_is_insufficient_with_the_minimum_stated() -> None:
    result = analyze([1.0] * 29)
    assert result.classification == C.INSUFFICIENT
    assert "at least 30" in result.reason
    assert result.steady_throughput is None
    assert json.loads(result.to_json())["classification"] == "insufficient"


def test_empty_series_is_insufficient() -> None:
    assert analyze([]).classification == C.INSUFFICIENT


def test_constant_series_is_flat() -> None:
    result = analyze(np.full(100, 3.0))
    assert result.classification == C.FLAT
    assert result.steady_throughput == 3.0
    assert result.sustained_ratio == 1.0
    assert result.changepoints == ()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([1.0, float("nan"), 1.0], "throughput[1] is nan"),
        ([1.0, 2.0, float("inf")], "throughput[2] is inf"),
        ([1.0, -2.0, 1.0], "throughput[1] is -2.0, not positive"),
        ([1.0, 0.0], "throughput[1] is 0.0, not positive"),
        ([[1.0, 2.0]], "one-dimensional"),
    ],
)
def test_invalid_series_are_rejected(values: list[float], message: str) -> None:
    with pytest.raises(InvalidSeriesError, match=message.replace("[", r"\[").replace("]", r"\]")):
        analyze(values)


def test_end_times_must_match_the_series() -> None:
    with pytest.raises(InvalidSeriesError, match="end_times has 2 values"):
        analyze([1.0] * 40, [1.0, 2.0])


def test_warmup_seconds_from_end_times() -> None:
    case = make_case("warmup_step", 7)
    ends = np.arange(1, case.series.size + 1, dtype=np.float64) * 0.5
    result = analyze(case.series, ends)
    assert result.classification == C.WARMUP
    assert result.steady_start_index is not None
    assert result.warmup_seconds == pytest.approx(0.5 * result.steady_start_index)


def test_durations_give_throughput_latency_and_seconds() -> None:
    rng = np.random.default_rng(3)
    durations = np.r_[np.full(100, 0.02), np.full(400, 0.01)] * (
        1 + 0.005 * rng.standard_normal(500)
    )
    result = analyze_durations(durations)
    assert result.classification == C.WARMUP
    assert result.steady_start_index == 100
    assert result.warmup_seconds == pytest.approx(float(np.sum(durations[:100])))
    assert result.steady_throughput == pytest.approx(100.0, rel=0.01)
    assert result.latency_p50_seconds == pytest.approx(0.01, rel=0.02)
    assert result.latency_p99_seconds == pytest.approx(0.02, rel=0.05)
    document = json.loads(result.to_json())
    for key in (
        "classification",
        "n",
        "steady_start_index",
        "steady_throughput",
        "steady_ci",
        "peak_throughput",
        "sustained_ratio",
        "changepoints",
        "warmup_seconds",
        "mser5_index",
        "reason",
    ):
        assert key in document


def test_latency_percentiles() -> None:
    p50, p90, p99 = latency_percentiles(np.arange(1, 101, dtype=np.float64))
    assert (p50, p90, p99) == pytest.approx((50.5, 90.1, 99.01))


def test_an_isolated_spike_at_the_start_is_not_a_warmup() -> None:
    series = noise_series(11, 300, 0.005)
    series[0] *= 0.1
    series[1] *= 0.2
    result = analyze(series)
    assert result.classification == C.FLAT
    assert result.outliers >= 2


def test_a_late_slowdown_is_never_insufficient() -> None:
    series = noise_series(12, 1000, 0.005)
    series[700:] *= 0.8
    result = analyze(series)
    assert result.classification == C.SLOWDOWN
    assert result.steady_start_index == 700


def test_outlier_rule_keeps_both_sides_of_a_step() -> None:
    series = np.r_[np.full(300, 10.0), np.full(300, 14.0)] + np.random.default_rng(4).normal(
        0, 0.05, 600
    )
    series[100] = 30.0
    keep = inlier_mask(series)
    assert not keep[100]
    assert keep.sum() == 599


def test_pelt_matches_ruptures() -> None:
    rpt = pytest.importorskip("ruptures")
    rng = np.random.default_rng(5)
    values = np.r_[rng.normal(0, 1, 100), rng.normal(3, 1, 150), rng.normal(-1, 1, 80)]
    penalty = 15 * math.log(values.size)
    expected = rpt.Pelt(model="l2", min_size=5, jump=1).fit(values).predict(pen=penalty)
    assert pelt_mean(values, penalty, 5) == expected[:-1]


def test_pelt_on_a_grid_refines_to_the_exact_change() -> None:
    rng = np.random.default_rng(6)
    values = np.r_[rng.normal(0, 1, 1233), rng.normal(2, 1, 3000)]
    assert pelt_mean(values, 15 * math.log(values.size), 5, jump=5) == [1233]


def test_mser5_finds_the_end_of_a_warmup() -> None:
    rng = np.random.default_rng(8)
    values = np.r_[np.full(200, 80.0), np.full(800, 100.0)] + rng.normal(0, 0.5, 1000)
    assert mser5(values) == 200


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_reads_csv_json_array_and_json_lines(tmp_path: Path) -> None:
    csv_file = write(tmp_path, "a.csv", "step,seconds\n0,0.5\n1,0.25\n\n")
    assert list(read_series(csv_file, "seconds")) == [0.5, 0.25]
    assert list(read_series(write(tmp_path, "b.csv", "seconds\n2\n4\n"))) == [2.0, 4.0]
    assert list(read_series(write(tmp_path, "c.json", '[1, 2.5, "3"]'))) == [1.0, 2.5, 3.0]
    lines = write(tmp_path, "d.jsonl", '{"s": 1, "i": 0}\n\n{"s": 2, "i": 1}\n')
    assert list(read_series(lines, "s")) == [1.0, 2.0]


@pytest.mark.parametrize(
    ("name", "text", "column", "message"),
    [
        ("e.csv", "seconds\n", None, "no values"),
        ("e.json", "[]", None, "no values"),
        ("f.csv", "seconds\n0.1\nabc\n", None, "line 3: 'abc' is not a number"),
        ("g.csv", "seconds\n0.1\nnan\n", None, "line 3: 'nan' is not a finite number"),
        ("h.csv", "seconds\n0.1\ninf\n", None, "line 3: 'inf' is not a finite number"),
        ("i.csv", "seconds\n-0.1\n", None, "line 2: duration '-0.1' is not positive"),
        ("j.csv", "a,b\n1,2\n", None, "line 1: several columns (a, b)"),
        ("k.csv", "a,b\n1,2\n", "c", "line 1: no column 'c'"),
        ("l.json", "[1, null]", None, "element 1: None is not a number"),
        ("m.json", "[1, true]", None, "element 1: True is not a number"),
        ("n.jsonl", '{"s": 1}\n{"s": NaN}\n', "s", "line 2: nan is not a finite number"),
        ("o.jsonl", '{"s": 1}\n{"t": 2}\n', "s", "line 2: no field 's'"),
        ("p.jsonl", '{"s": 1}\n{oops\n', "s", "line 2: not valid JSON"),
    ],
)
def test_bad_series_files_name_the_line(
    tmp_path: Path, name: str, text: str, column: str | None, message: str
) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(SeriesInputError) as info:
        read_series(path, column)
    assert message in str(info.value)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SeriesInputError, match="no such file"):
        read_series(tmp_path / "absent.csv")


def test_analyze_file_and_summary(tmp_path: Path) -> None:
    durations = np.r_[np.full(50, 0.02), np.full(250, 0.01)]
    path = write(tmp_path, "run.csv", "seconds\n" + "\n".join(map(str, durations)) + "\n")
    result = analyze_file(path, kind="duration")
    assert result.classification == C.WARMUP
    assert result.steady_start_index == 50
    text = render_summary(result)
    assert text.splitlines()[0] == "warmup (300 iterations)"
    assert "steady from iteration 50" in text
    throughput = analyze_file(path, kind="throughput")
    assert throughput.classification == C.SLOWDOWN
