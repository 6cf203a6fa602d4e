"""Per-probe steady-state analysis: outliers, change points, classification, figures.

Method (DESIGN.md, "Analysis (per probe)"; Barrett et al., OOPSLA 2017; Traini et al., EMSE 2023):

1. Outliers by Barrett's rule over the whole series; they are removed before segmentation and
   an index map takes every position back to the original series.
2. PELT on the mean of the values in % of the median, divided by the noise level, with a
   penalty of `PENALTY_PER_LOG_N`·ln n: the noise normalisation is what makes one penalty hold for
   noise from 0.3% to 2%.
3. Walking back from the final segment, every segment equivalent to it (relative difference
   within max(tolerance, the 99% CI half-width of the difference)) joins the steady regime.
   Steady state holds when that regime covers the last `min_steady_fraction` of the run and
   neither an oscillation nor a drift runs through its tail. The segment adjacent to the steady
   regime decides the class: faster means slowdown, slower means warm-up; earlier segments do
   not matter (a run that warms up, overshoots and settles is a slowdown, because what the user
   sees last is a drop).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
from numpy.typing import NDArray
from scipy import stats  # type: ignore[import-untyped]

from agent.analysis.changepoints import noise_scale, pelt_mean
from agent.analysis.figures import bootstrap_mean_ci, latency_percentiles, peak
from agent.analysis.mser import mser5
from agent.analysis.outliers import inlier_mask
from agent.analysis.result import Classification, SteadyStateResult
from agent.verdict import MIN_ITERATIONS

DEFAULT_TOLERANCE = 0.02
MIN_STEADY_FRACTION = 0.25
MIN_SEGMENT = 5
PENALTY_PER_LOG_N = 15.0
GRID_POINTS = 600  # above this many iterations PELT searches a coarser grid, then refines
CI_Z = 2.576  # 99% two-sided, for widening the equivalence band of short noisy segments
DRIFT_P_VALUE = 1e-3
OSCILLATION_P_VALUE = 1e-3
OSCILLATION_MIN_CYCLES = 2
OSCILLATION_MIN_POINTS = 16


class InvalidSeriesError(ValueError):
    """A series the analysis cannot take (not finite, not positive, mismatched end times)."""


def analyze(
    throughput: Sequence[float] | NDArray[np.float64],
    end_times: Sequence[float] | NDArray[np.float64] | None = None,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    min_iterations: int = MIN_ITERATIONS,
    min_steady_fraction: float = MIN_STEADY_FRACTION,
    seed: int = 0,
) -> SteadyStateResult:
    """Analyse a throughput series (work per second, one value per iteration).

    `end_times` are the seconds from the start of the run to the end of each iteration; with
    them the start of the steady regime is also given in seconds. `tolerance` is the relative
    difference under which two segments count as the same level (Traini et al. use 0.05).
    """
    x = _as_series(throughput, "throughput")
    ends = None if end_times is None else _as_series(end_times, "end_times", positive=False)
    if ends is not None and ends.size != x.size:
        raise InvalidSeriesError(f"end_times has {ends.size} values but throughput has {x.size}")
    if not 0.0 < tolerance < 1.0:
        raise InvalidSeriesError(f"tolerance must be in (0, 1), got {tolerance}")
    n = x.size
    if n < min_iterations:
        return SteadyStateResult(
            classification=Classification.INSUFFICIENT,
            n=n,
            tolerance=tolerance,
            reason=f"{n} iterations; at least {min_iterations} are needed to decide",
        )
    keep = inlier_mask(x)
    kept_index = np.flatnonzero(keep)
    xf = x[keep]
    m = xf.size
    outliers = n - m
    if m < min_iterations:
        return SteadyStateResult(
            classification=Classification.INSUFFICIENT,
            n=n,
            tolerance=tolerance,
            outliers=outliers,
            reason=(
                f"{m} iterations left after removing {outliers} outliers; "
                f"at least {min_iterations} are needed to decide"
            ),
        )

    relative = xf / float(np.median(xf)) - 1.0
    sigma = noise_scale(relative)
    jump = min(MIN_SEGMENT, max(1, m // GRID_POINTS))
    penalty = PENALTY_PER_LOG_N * math.log(m)
    starts_f = pelt_mean(relative / sigma, penalty, MIN_SEGMENT, jump)
    bounds = [0, *starts_f, m]
    segments = [xf[a:b] for a, b in itertools.pairwise(bounds)]

    def original_start(b: int) -> int:
        # An outlier just before a boundary belongs to the earlier segment.
        return 0 if b == 0 else int(kept_index[b - 1]) + 1

    changepoints = tuple(original_start(b) for b in starts_f)
    first_steady = _first_equivalent(segments, tolerance)
    steady_start = original_start(bounds[first_steady])
    steady_values = xf[bounds[first_steady] :]
    steady_mean = float(np.mean(steady_values))
    peak_value = peak(xf)
    unsteady = SteadyStateResult(
        classification=Classification.NO_STEADY_STATE,
        n=n,
        tolerance=tolerance,
        reason="",
        peak_throughput=peak_value,
        changepoints=changepoints,
        mser5_index=_original_mser5(xf, kept_index),
        outliers=outliers,
    )

    required = math.ceil(min_steady_fraction * n)
    verdict: str | None
    if n - steady_start < required:
        verdict = (
            f"the final regime starts at iteration {steady_start}, so it does not cover the "
            f"last {min_steady_fraction:.0%} of the run (from iteration {n - required})"
        )
    else:
        tail = xf[kept_index >= n - required] / steady_mean
        verdict = _oscillation(tail, tolerance) or _drift(steady_values / steady_mean, tolerance)
    if verdict is not None:
        return replace(unsteady, reason=verdict)

    if first_steady == 0:
        classification = Classification.FLAT
        reason = f"one steady regime from the start, within {tolerance:.1%}"
    else:
        before = float(np.mean(segments[first_steady - 1]))
        change = steady_mean / before - 1.0
        slower = before > steady_mean
        classification = Classification.SLOWDOWN if slower else Classification.WARMUP
        reason = (
            f"steady from iteration {steady_start}, {change:+.1%} against the segment before it"
        )
    ci = bootstrap_mean_ci(segments[first_steady:], seed=seed)
    return replace(
        unsteady,
        classification=classification,
        reason=reason,
        steady_start_index=steady_start,
        steady_throughput=steady_mean,
        steady_ci=ci,
        sustained_ratio=steady_mean / peak_value,
        warmup_seconds=_seconds_before(ends, steady_start),
        warmup_throughput=(
            float(np.mean(xf[: bounds[first_steady]]))
            if classification is Classification.WARMUP
            else None
        ),
    )


def analyze_durations(
    durations: Sequence[float] | NDArray[np.float64],
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    min_iterations: int = MIN_ITERATIONS,
    min_steady_fraction: float = MIN_STEADY_FRACTION,
    seed: int = 0,
) -> SteadyStateResult:
    """Analyse per-iteration durations (seconds) as throughput 1/duration, back to back in time.

    Adds the latency percentiles of the durations; throughputs are then iterations per second.
    """
    d = _as_series(durations, "durations")
    result = analyze(
        1.0 / d,
        np.cumsum(d),
        tolerance=tolerance,
        min_iterations=min_iterations,
        min_steady_fraction=min_steady_fraction,
        seed=seed,
    )
    if d.size == 0:
        return result
    p50, p90, p99 = latency_percentiles(d)
    return _with_latency(result, p50, p90, p99)


def _with_latency(
    result: SteadyStateResult, p50: float, p90: float, p99: float
) -> SteadyStateResult:
    return replace(
        result, latency_p50_seconds=p50, latency_p90_seconds=p90, latency_p99_seconds=p99
    )


def _as_series(
    values: Sequence[float] | NDArray[np.float64], name: str, positive: bool = True
) -> NDArray[np.float64]:
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise InvalidSeriesError(f"{name} is not a series of numbers: {e}") from e
    if array.ndim != 1:
        raise InvalidSeriesError(f"{name} must be one-dimensional, got shape {array.shape}")
    bad = np.flatnonzero(~np.isfinite(array))
    if bad.size:
        raise InvalidSeriesError(f"{name}[{bad[0]}] is {array[bad[0]]}, not a finite number")
    if positive:
        bad = np.flatnonzero(array <= 0.0)
        if bad.size:
            raise InvalidSeriesError(f"{name}[{bad[0]}] is {array[bad[0]]}, not positive")
    return array


def _equivalent(segment: NDArray[np.float64], final: NDArray[np.float64], tolerance: float) -> bool:
    """Same level: difference within tolerance, or within the noise of two short segments."""
    final_mean = float(np.mean(final))
    difference = abs(float(np.mean(segment)) - final_mean) / final_mean
    spread = (
        CI_Z
        * math.sqrt(float(np.var(segment)) / segment.size + float(np.var(final)) / final.size)
        / final_mean
    )
    return difference <= max(tolerance, spread)


def _first_equivalent(segments: list[NDArray[np.float64]], tolerance: float) -> int:
    """Index of the earliest segment of the unbroken run of segments equivalent to the last."""
    final = segments[-1]
    first = len(segments) - 1
    while first > 0 and _equivalent(segments[first - 1], final, tolerance):
        first -= 1
    return first


def _oscillation(tail: NDArray[np.float64], tolerance: float) -> str | None:
    """A periodic component in the trailing window larger than the tolerance (Fisher's g test).

    PELT misses cycles shorter than a few segments' worth of iterations; a spectral peak does
    not. At least two full cycles must fit in the window, so a slow drift is left to `_drift`.
    """
    size = tail.size
    if size < OSCILLATION_MIN_POINTS:
        return None
    t = np.arange(size, dtype=np.float64)
    slope, intercept = np.polyfit(t, tail, 1)
    residual = tail - (slope * t + intercept)
    power = np.abs(np.fft.rfft(residual)) ** 2
    frequencies = power[1 : (size - 1) // 2 + 1]
    total = float(np.sum(frequencies))
    if frequencies.size < OSCILLATION_MIN_CYCLES or total <= 0.0:
        return None
    k = int(np.argmax(frequencies)) + 1
    if k < OSCILLATION_MIN_CYCLES:
        return None
    g = float(frequencies[k - 1]) / total
    count = frequencies.size
    p_value = min(1.0, count * (1.0 - g) ** (count - 1))
    amplitude = 2.0 * math.sqrt(float(frequencies[k - 1])) / size
    if p_value < OSCILLATION_P_VALUE and amplitude > tolerance:
        return (
            f"oscillation in the last iterations: period about {size / k:.0f} iterations, "
            f"amplitude {amplitude:.1%}"
        )
    return None


def _drift(steady: NDArray[np.float64], tolerance: float) -> str | None:
    """A significant slope that moves the steady regime by more than the tolerance end to end."""
    if steady.size < 3 or float(np.ptp(steady)) == 0.0:
        return None
    fit = stats.linregress(np.arange(steady.size, dtype=np.float64), steady)
    change = float(fit.slope) * (steady.size - 1)
    if abs(change) > tolerance and float(fit.pvalue) < DRIFT_P_VALUE:
        return f"drift of {change:+.1%} across the last regime ({steady.size} iterations)"
    return None


def _original_mser5(values: NDArray[np.float64], kept_index: NDArray[np.int64]) -> int | None:
    cut = mser5(values)
    return None if cut is None else int(kept_index[cut])


def _seconds_before(ends: NDArray[np.float64] | None, index: int) -> float | None:
    if ends is None:
        return None
    return 0.0 if index == 0 else float(ends[index - 1])
