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

from agent.analysis.changepoints import noise_scale, pelt_mean
from agent.analysis.figures import (
    MAX_TEXTURE_PERIOD,
    block_bootstrap_ci,
    delivered,
    dependence,
    latency_percentiles,
    peak,
    peak_window,
    ratio_dependence,
    texture_period,
)
from agent.analysis.mser import mser5
from agent.analysis.outliers import inlier_mask
from agent.analysis.result import Classification, SteadyStateResult
from agent.analysis.significance import student_t_two_sided_p
from agent.verdict import MIN_ITERATIONS

DEFAULT_TOLERANCE = 0.02
MIN_STEADY_FRACTION = 0.25
MIN_SEGMENT = 5
PENALTY_PER_LOG_N = 15.0
GRID_POINTS = 600  # above this many iterations PELT searches a coarser grid, then refines
MAX_GRID_POINTS = 4000  # and never more grid points than this: PELT can be quadratic in them
CI_Z = 2.576  # 99% two-sided, for widening the equivalence band of short noisy segments
DRIFT_P_VALUE = 1e-3
OSCILLATION_P_VALUE = 1e-3
OSCILLATION_MIN_CYCLES = 2
OSCILLATION_MIN_POINTS = 16
MAX_BACKGROUND_PHI = 0.95


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

    `end_times` are the seconds from the start of the run to the end of each iteration, back to
    back: each iteration then took the time since the one before, and the figures weigh it by
    that time. Without them every value counts for the same time, as samples of a fixed window
    do. `tolerance` is the relative difference under which two segments count as the same level
    (Traini et al. use 0.05).
    """
    x = _as_series(throughput, "throughput")
    if end_times is None:
        seconds = np.ones_like(x)
        ends = None
    else:
        ends = _as_series(end_times, "end_times", positive=False)
        if ends.size != x.size:
            raise InvalidSeriesError(
                f"end_times has {ends.size} values but throughput has {x.size}"
            )
        seconds = np.diff(ends, prepend=0.0)
        bad = np.flatnonzero(seconds <= 0.0)
        if bad.size:
            raise InvalidSeriesError(
                f"end_times[{bad[0]}] is {ends[bad[0]]}, not after the iteration before it"
            )
    return analyze_work(
        x * seconds,
        seconds,
        ends,
        tolerance=tolerance,
        min_iterations=min_iterations,
        min_steady_fraction=min_steady_fraction,
        seed=seed,
    )


def analyze_work(
    work: NDArray[np.float64],
    seconds: NDArray[np.float64],
    end_times: NDArray[np.float64] | None = None,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    min_iterations: int = MIN_ITERATIONS,
    min_steady_fraction: float = MIN_STEADY_FRACTION,
    seed: int = 0,
) -> SteadyStateResult:
    """Analyse iterations given as work done and seconds taken, each positive.

    The regimes are found on the rates (work / seconds) of units: single iterations, or whole
    periods of a short repeating pattern (`texture_period`), so that two kernels alternating or
    a pause every few iterations read as the run's texture, not as change or oscillation. The
    figures are work over time over the iterations themselves, outliers included.
    """
    if not 0.0 < tolerance < 1.0:
        raise InvalidSeriesError(f"tolerance must be in (0, 1), got {tolerance}")
    n = work.size
    if n < min_iterations:
        return SteadyStateResult(
            classification=Classification.INSUFFICIENT,
            n=n,
            tolerance=tolerance,
            reason=f"{n} iterations; at least {min_iterations} are needed to decide",
        )
    period = texture_period(work / seconds)
    units = n // period
    unit_work = work[: units * period].reshape(units, period).sum(axis=1)
    unit_seconds = seconds[: units * period].reshape(units, period).sum(axis=1)
    x = unit_work / unit_seconds
    keep = inlier_mask(x)
    kept_index = np.flatnonzero(keep)
    xf = x[keep]
    m = xf.size
    outliers = units - m
    needed = min_iterations if period == 1 else 2 * MIN_SEGMENT
    if m < needed:
        what = "iterations" if period == 1 else f"periods of {period} iterations"
        return SteadyStateResult(
            classification=Classification.INSUFFICIENT,
            n=n,
            tolerance=tolerance,
            outliers=outliers * period,
            texture_period=period,
            reason=(
                f"{m} {what} left after removing {outliers} outliers; "
                f"at least {needed} are needed to decide"
            ),
        )

    starts_f, segments, first_steady = _segment(xf, tolerance)
    bounds = [0, *starts_f, m]

    def original_start(b: int) -> int:
        # An outlier just before a boundary belongs to the earlier segment; units to iterations.
        return 0 if b == 0 else (int(kept_index[b - 1]) + 1) * period

    changepoints = tuple(original_start(b) for b in starts_f)
    steady_start = original_start(bounds[first_steady])
    steady_work, steady_seconds = work[steady_start:], seconds[steady_start:]
    steady_value = delivered(steady_work, steady_seconds)
    window = peak_window(n, period)
    peak_value = max(peak(work, seconds, window), steady_value)
    steady_dependence = ratio_dependence(steady_work, steady_seconds)
    block = period * math.ceil(steady_dependence.block / period)
    unsteady = SteadyStateResult(
        classification=Classification.NO_STEADY_STATE,
        n=n,
        tolerance=tolerance,
        reason="",
        peak_throughput=peak_value,
        peak_window_iterations=window,
        changepoints=changepoints,
        mser5_index=_original_mser5(xf, kept_index, period),
        outliers=outliers * period,
        texture_period=period,
    )

    verdict = _why_unsteady(
        xf[kept_index * period >= steady_start],
        xf[kept_index * period >= n - math.ceil(min_steady_fraction * n)],
        steady_start=steady_start,
        n=n,
        min_steady_fraction=min_steady_fraction,
        tolerance=tolerance,
        period=period,
        block=block,
    )
    if verdict is not None:
        return replace(unsteady, reason=verdict)

    if first_steady == 0:
        classification = Classification.FLAT
        reason = f"one steady regime from the start, within {tolerance:.1%}"
    else:
        before = float(np.mean(segments[first_steady - 1]))
        change = float(np.mean(xf[bounds[first_steady] :])) / before - 1.0
        slower = change < 0.0
        classification = Classification.SLOWDOWN if slower else Classification.WARMUP
        reason = (
            f"steady from iteration {steady_start}, {change:+.1%} against the segment before it"
        )
    if period > 1:
        reason += f"; a pattern repeating every {period} iterations is read as one unit"
    return replace(
        unsteady,
        classification=classification,
        reason=reason,
        steady_start_index=steady_start,
        steady_throughput=steady_value,
        steady_ci=block_bootstrap_ci(
            steady_work,
            steady_seconds,
            block,
            seed=seed,
            inflation=steady_dependence.bootstrap_inflation,
        ),
        bootstrap_block_iterations=block,
        sustained_ratio=steady_value / peak_value,
        warmup_seconds=_seconds_before(end_times, steady_start),
        warmup_throughput=(
            delivered(work[:steady_start], seconds[:steady_start])
            if classification is Classification.WARMUP
            else None
        ),
    )


def _why_unsteady(
    steady_units: NDArray[np.float64],
    tail_units: NDArray[np.float64],
    *,
    steady_start: int,
    n: int,
    min_steady_fraction: float,
    tolerance: float,
    period: int,
    block: int,
) -> str | None:
    """Why the final regime is no steady state (too short, a cycle, a drift), or None."""
    required = math.ceil(min_steady_fraction * n)
    if n - steady_start < required:
        return (
            f"the final regime starts at iteration {steady_start}, so it does not cover the "
            f"last {min_steady_fraction:.0%} of the run (from iteration {n - required})"
        )
    # A drift is judged on blocks as long as the bootstrap's: one block's mean is nearly
    # independent of the next, so a control loop's slow wander does not pass for a trend.
    group = max(1, block // period)
    level = float(np.mean(steady_units))
    return _oscillation(tail_units / level, tolerance, period) or _drift(
        _block_means(steady_units / level, group), tolerance, group * period
    )


def _segment(
    xf: NDArray[np.float64], tolerance: float
) -> tuple[list[int], list[NDArray[np.float64]], int]:
    """PELT's segment starts, the segments, and the first of the steady regime's segments."""
    m = xf.size
    relative = xf / float(np.median(xf)) - 1.0
    sigma = noise_scale(relative)
    jump = max(min(MIN_SEGMENT, m // GRID_POINTS), m // MAX_GRID_POINTS)
    penalty = PENALTY_PER_LOG_N * math.log(m)
    starts_f = pelt_mean(relative / sigma, penalty, MIN_SEGMENT, jump)
    bounds = [0, *starts_f, m]
    segments = [xf[a:b] for a, b in itertools.pairwise(bounds)]
    # Neighbouring iterations are alike (control loops, caches): a segment's mean is then less
    # certain than its size suggests, by the long-run variance ratio of the noise around the
    # segments' means.
    noise = np.concatenate([segment - float(np.mean(segment)) for segment in segments])
    noise_variance = float(np.var(noise))
    variance_ratio = dependence(noise).variance_ratio
    return (
        starts_f,
        segments,
        _first_equivalent(segments, tolerance, noise_variance, variance_ratio),
    )


def analyze_durations(
    durations: Sequence[float] | NDArray[np.float64],
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    min_iterations: int = MIN_ITERATIONS,
    min_steady_fraction: float = MIN_STEADY_FRACTION,
    seed: int = 0,
) -> SteadyStateResult:
    """Analyse per-iteration durations (seconds), one unit of work each, back to back in time.

    Adds the latency percentiles of the durations; throughputs are then iterations per second.
    """
    d = _as_series(durations, "durations")
    result = analyze_work(
        np.ones_like(d),
        d,
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


def _equivalent(
    segment: NDArray[np.float64],
    final: NDArray[np.float64],
    tolerance: float,
    pooled: float,
    variance_ratio: float,
) -> bool:
    """Same level: difference within tolerance, or within the noise of two short segments.

    Each segment's variance is at least the ``pooled`` variance of the noise around all segments'
    means (a short segment's own spread understates how far its mean can stray), and grows by
    the noise's long-run ``variance_ratio`` when neighbouring iterations are alike.
    """
    final_mean = float(np.mean(final))
    difference = abs(float(np.mean(segment)) - final_mean) / final_mean
    own = max(float(np.var(segment)), pooled) / segment.size
    last = max(float(np.var(final)), pooled) / final.size
    spread = CI_Z * math.sqrt(variance_ratio * (own + last)) / final_mean
    return difference <= max(tolerance, spread)


def _first_equivalent(
    segments: list[NDArray[np.float64]], tolerance: float, pooled: float, variance_ratio: float
) -> int:
    """Index of the earliest segment of the unbroken run of segments equivalent to the last."""
    final = segments[-1]
    first = len(segments) - 1
    while first > 0 and _equivalent(segments[first - 1], final, tolerance, pooled, variance_ratio):
        first -= 1
    return first


def _block_means(values: NDArray[np.float64], size: int) -> NDArray[np.float64]:
    """Means of consecutive blocks of ``size`` values (a shorter last block is left out)."""
    if size <= 1:
        return values
    count = values.size // size
    means: NDArray[np.float64] = values[: count * size].reshape(count, size).mean(axis=1)
    return means


def _oscillation(tail: NDArray[np.float64], tolerance: float, per_point: int) -> str | None:
    """A periodic component in the trailing window larger than the tolerance (Fisher's g test
    against an AR(1) background).

    PELT misses cycles shorter than a few segments' worth of iterations; a spectral peak does
    not. At least two full cycles must fit in the window, so a slow drift is left to `_drift`,
    and a cycle must be longer than `MAX_TEXTURE_PERIOD` iterations: a shorter one is the
    workload's texture. Iteration times wander (clock and thermal control loops), which piles
    power into the low frequencies without any cycle; the periodogram is divided by the spectrum
    of an AR(1) process before the test. Its coefficient comes from the first differences
    (lag-1 correlation rho gives phi = 1 + 2 rho), which a slow cycle barely touches, so a real
    cycle does not whiten itself away. ``per_point`` is the number of iterations behind each value.
    """
    size = tail.size
    if size < OSCILLATION_MIN_POINTS:
        return None
    t = np.arange(size, dtype=np.float64)
    slope, intercept = np.polyfit(t, tail, 1)
    residual = tail - (slope * t + intercept)
    power = np.abs(np.fft.rfft(residual)) ** 2
    count = (size - 1) // 2
    raw = power[1 : count + 1]
    longest_k = min(count, int(size * per_point / (MAX_TEXTURE_PERIOD + 1)))
    if longest_k < OSCILLATION_MIN_CYCLES or float(np.sum(raw)) <= 0.0:
        return None
    steps = np.diff(residual)
    phi = 0.0
    if float(np.var(steps)) > 0.0:
        rho = float(np.corrcoef(steps[:-1], steps[1:])[0, 1]) if steps.size > 2 else -0.5
        phi = min(MAX_BACKGROUND_PHI, max(0.0, 1.0 + 2.0 * rho))
    frequency = np.arange(1, count + 1) / size
    background = 1.0 / (1.0 - 2.0 * phi * np.cos(2.0 * np.pi * frequency) + phi * phi)
    white = raw / background
    k = int(np.argmax(white[:longest_k])) + 1
    if k < OSCILLATION_MIN_CYCLES:
        return None
    g = float(white[k - 1]) / float(np.sum(white))
    p_value = min(1.0, count * (1.0 - g) ** (count - 1))
    amplitude = 2.0 * math.sqrt(float(raw[k - 1])) / size
    if p_value < OSCILLATION_P_VALUE and amplitude > tolerance:
        return (
            f"oscillation in the last iterations: period about {size * per_point / k:.0f} "
            f"iterations, amplitude {amplitude:.1%}"
        )
    return None


def _drift(steady: NDArray[np.float64], tolerance: float, per_point: int) -> str | None:
    """A significant slope that moves the steady regime by more than the tolerance end to end."""
    size = steady.size
    if size < 3 or float(np.ptp(steady)) == 0.0:
        return None
    t = np.arange(size, dtype=np.float64)
    t -= float(np.mean(t))
    slope = float(np.dot(t, steady - float(np.mean(steady))) / np.dot(t, t))
    residual = steady - float(np.mean(steady)) - slope * t
    df = size - 2
    error = math.sqrt(float(np.dot(residual, residual)) / df / float(np.dot(t, t)))
    change = slope * (size - 1)
    if abs(change) <= tolerance:
        return None
    if error > 0.0 and student_t_two_sided_p(slope / error, df) >= DRIFT_P_VALUE:
        return None
    return f"drift of {change:+.1%} across the last regime ({size * per_point} iterations)"


def _original_mser5(
    values: NDArray[np.float64], kept_index: NDArray[np.int64], period: int
) -> int | None:
    cut = mser5(values)
    return None if cut is None else int(kept_index[cut]) * period


def _seconds_before(ends: NDArray[np.float64] | None, index: int) -> float | None:
    if ends is None:
        return None
    return 0.0 if index == 0 else float(ends[index - 1])
