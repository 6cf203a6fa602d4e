"""Delivered throughput, peak, the steady value's interval, windowed and latency percentiles.

Every throughput figure here is work over time: the work the iterations did divided by the time
they took, never a mean of per-iteration rates. A mean of rates overstates whenever iteration
times vary (Jensen's inequality: one slow iteration lowers the rate of one value, but costs the
run all the time it took), and it is the time a planner pays for. Peak is the best window of
consecutive iterations by the same rule rather than the best single iteration, so that one lucky
iteration does not set the reference the sustained ratio is measured against. The windowed
percentiles exist for the run that never settles: it has no steady value, yet its p10 over
one-second windows still tells a planner what it delivered at worst.

Cost: everything is O(n log n) time and O(n) memory, so an hour-long run (hundreds of thousands of
iterations) is ordinary input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

PEAK_WINDOW_FRACTION = 0.05
PEAK_MIN_WINDOW = 5
BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_CHUNK_PICKS = 1 << 21  # block starts drawn at once: bounds the bootstrap's memory
CONFIDENCE = 0.99
MAX_TEXTURE_PERIOD = 48  # "a pause every few dozen iterations" is texture, not oscillation
TEXTURE_MIN_CORRELATION = 0.5
TEXTURE_MIN_REPEATS = 10


def delivered(work: NDArray[np.float64], seconds: NDArray[np.float64]) -> float:
    """Total work over total time."""
    return float(np.sum(work) / np.sum(seconds))


def peak_window(n: int, period: int = 1) -> int:
    """Iterations in the peak's window: 5% of the run, at least 5, a whole number of periods."""
    w = max(PEAK_MIN_WINDOW, round(PEAK_WINDOW_FRACTION * n))
    return min(n, period * math.ceil(w / period))


def peak(work: NDArray[np.float64], seconds: NDArray[np.float64], window: int) -> float:
    """The best work over time of ``window`` consecutive iterations."""
    if work.size <= window:
        return delivered(work, seconds)
    cw = np.concatenate(([0.0], np.cumsum(work)))
    cs = np.concatenate(([0.0], np.cumsum(seconds)))
    return float(np.max((cw[window:] - cw[:-window]) / (cs[window:] - cs[:-window])))


def texture_period(rates: NDArray[np.float64]) -> int:
    """The period of a short repeating pattern (two kernels alternating, a pause every k
    iterations), or 1 when there is none.

    A repeating pattern shows as a peak of the autocorrelation at its period after a dip: the
    autocorrelation of the ordinary, slowly decaying kind (clock and thermal control loops) has no
    dip, so it is not taken for a pattern. Periods up to `MAX_TEXTURE_PERIOD` that repeat at least
    `TEXTURE_MIN_REPEATS` times count; a longer one is left to the oscillation test.
    """
    max_lag = min(MAX_TEXTURE_PERIOD, rates.size // TEXTURE_MIN_REPEATS)
    if max_lag < 2:
        return 1
    acf = autocorrelation(rates, max_lag + 2)
    if acf is None:
        return 1
    for lag in range(2, max_lag + 1):
        dip = float(np.min(acf[1:lag]))
        if (
            acf[lag] >= TEXTURE_MIN_CORRELATION
            and acf[lag] >= acf[lag - 1]
            and acf[lag] >= acf[lag + 1]
            and acf[lag] - dip >= TEXTURE_MIN_CORRELATION
        ):
            return lag
    return 1


def autocorrelation(values: NDArray[np.float64], lags: int) -> NDArray[np.float64] | None:
    """Sample autocorrelation at lags 0..lags-1 (FFT, O(n log n)); None for a constant series."""
    centred = values - float(np.mean(values))
    n = centred.size
    size = 1 << (2 * n - 1).bit_length()
    spectrum = np.fft.rfft(centred, size)
    covariance = np.fft.irfft(spectrum * np.conj(spectrum), size)[:lags]
    if covariance[0] <= 0.0:
        return None
    result: NDArray[np.float64] = (covariance / covariance[0]).astype(np.float64)
    return result


@dataclass(frozen=True, slots=True)
class Dependence:
    """How far a series' iterations depend on one another, from its flat-top spectral estimates.

    ``block``: the circular block bootstrap's block length (Politis and White 2004, corrected by
    Patton, Politis and White 2009; capped at min(3 sqrt(n), n / 3) as Kevin Sheppard's `arch`
    package does). ``variance_ratio``: the long-run variance over the plain variance (1 for
    independent iterations, about 19 for an AR(1) with phi 0.9), by which a mean's standard error
    grows. ``bootstrap_inflation``: the factor that undoes the block bootstrap's known downward
    bias of the variance, sigma^2 - G / block (Kuensch 1989), which is large when the dependence
    is strong and the run short.
    """

    block: int
    variance_ratio: float
    bootstrap_inflation: float


INDEPENDENT = Dependence(block=1, variance_ratio=1.0, bootstrap_inflation=1.0)
MAX_INFLATION = 2.0


def dependence(values: NDArray[np.float64]) -> Dependence:
    """The dependence of a series (for total work / total time, pass its influence series,
    work - ratio x seconds; `ratio_dependence` does)."""
    n = values.size
    if n < 9:
        return INDEPENDENT
    cap = max(1, math.ceil(min(3.0 * math.sqrt(n), n / 3.0)))
    k_n = max(5, math.ceil(math.sqrt(math.log10(n))))
    max_lag = min(n - 1, cap + k_n)
    acf = autocorrelation(values, max_lag + 1)
    if acf is None:
        return INDEPENDENT
    bound = 2.0 * math.sqrt(math.log10(n) / n)
    insignificant = np.abs(acf[1:]) < bound
    # The first lag m after which k_n autocorrelations in a row are insignificant.
    m = max_lag
    for lag in range(0, max_lag - k_n + 1):
        if bool(np.all(insignificant[lag : lag + k_n])):
            m = lag
            break
    big_m = max(1, min(2 * max(m, 1), max_lag))
    k = np.arange(-big_m, big_m + 1)
    t = np.abs(k) / big_m
    flat_top = np.where(t <= 0.5, 1.0, np.where(t <= 1.0, 2.0 * (1.0 - t), 0.0))
    r = acf[np.abs(k)]  # autocovariances in units of the variance
    g = float(np.sum(flat_top * np.abs(k) * r))
    long_run = float(np.sum(flat_top * r))
    if long_run <= 0.0 or g <= 0.0:
        return INDEPENDENT
    b = (2.0 * g * g / ((4.0 / 3.0) * long_run * long_run)) ** (1.0 / 3.0) * n ** (1.0 / 3.0)
    block = int(min(cap, max(1, math.ceil(b))))
    biased = max(long_run - g / block, long_run / (MAX_INFLATION * MAX_INFLATION))
    return Dependence(
        block=block,
        variance_ratio=max(1.0, long_run),
        bootstrap_inflation=math.sqrt(long_run / biased),
    )


def ratio_dependence(work: NDArray[np.float64], seconds: NDArray[np.float64]) -> Dependence:
    """The dependence of total work / total time: that of its influence series."""
    return dependence(work - delivered(work, seconds) * seconds)


def block_bootstrap_ci(
    work: NDArray[np.float64],
    seconds: NDArray[np.float64],
    block: int,
    *,
    seed: int = 0,
    resamples: int = BOOTSTRAP_RESAMPLES,
    inflation: float = 1.0,
) -> tuple[float, float]:
    """99% percentile interval of total work / total time by a circular block bootstrap.

    Blocks of ``block`` consecutive iterations keep the series' short-range dependence (an
    i.i.d. bootstrap of autocorrelated iterations makes the interval far too narrow). Each
    resample draws ceil(n / block) block starts; a block's work and time come from cumulative sums,
    so a resample costs O(n / block). The seed is fixed so the same series always yields the same
    interval. ``inflation`` widens the resampled ratios about the estimate (see `Dependence`).
    """
    n = work.size
    block = max(1, min(block, n))
    wrap_w = np.concatenate((work, work[: block - 1]))
    wrap_s = np.concatenate((seconds, seconds[: block - 1]))
    cw = np.concatenate(([0.0], np.cumsum(wrap_w)))
    cs = np.concatenate(([0.0], np.cumsum(wrap_s)))
    block_work = cw[block : block + n] - cw[:n]
    block_seconds = cs[block : block + n] - cs[:n]
    count = math.ceil(n / block)
    rng = np.random.default_rng(seed)
    ratios = np.empty(resamples)
    chunk = max(1, min(resamples, BOOTSTRAP_CHUNK_PICKS // count))
    for first in range(0, resamples, chunk):
        size = min(chunk, resamples - first)
        picks = rng.integers(0, n, size=(size, count))
        ratios[first : first + size] = block_work[picks].sum(axis=1) / block_seconds[picks].sum(
            axis=1
        )
    if inflation != 1.0:
        estimate = delivered(work, seconds)
        ratios = estimate + (ratios - estimate) * inflation
    tail = (1.0 - CONFIDENCE) / 2.0 * 100.0
    low, high = np.percentile(ratios, [tail, 100.0 - tail])
    return float(low), float(high)


WINDOW_SECONDS = 1.0
MIN_WINDOWS = 3
BUSY_FLOOR = 1e-9  # share of a window below which it had no iteration (rounding of the sums)


def window_series(
    starts: NDArray[np.float64],
    ends: NDArray[np.float64],
    work: NDArray[np.float64],
    window: float = WINDOW_SECONDS,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The throughput in consecutive windows of ``window`` seconds: (window starts, values),
    both in the clock of ``starts``, for the windows whole within the run that had work in them.

    Each window's throughput is the work done inside it over the time iterations were running
    inside it: an iteration that spans a boundary counts in both windows in proportion, and a gap
    between iterations (another phase, the timer's own work) is not charged as idle. Both sums
    come from running totals evaluated at the window edges, O((n + windows) log n).
    """
    empty = np.zeros(0)
    if starts.size == 0:
        return empty, empty
    origin = float(starts.min())
    count = int((float(ends.max()) - origin) // window)
    if count < 1:
        return empty, empty
    rate = work / (ends - starts)
    # Times from the first start, so the running totals do not lose digits to a large clock.
    edges = np.arange(count + 1, dtype=np.float64) * window
    busy = np.diff(_ramp_sum(starts - origin, ends - origin, np.ones_like(rate), edges))
    done = np.diff(_ramp_sum(starts - origin, ends - origin, rate, edges))
    kept = busy > BUSY_FLOOR * window
    values: NDArray[np.float64] = (done[kept] / busy[kept]).astype(np.float64)
    window_starts: NDArray[np.float64] = (origin + edges[:-1][kept]).astype(np.float64)
    return window_starts, values


def _ramp_sum(
    starts: NDArray[np.float64],
    ends: NDArray[np.float64],
    weight: NDArray[np.float64],
    at: NDArray[np.float64],
) -> NDArray[np.float64]:
    """sum_i weight_i * (time iteration i ran before t), for each t in ``at``.

    An iteration's time before t is max(t - start, 0) - max(t - end, 0); each of the two sums is
    a prefix sum over the iterations sorted by that boundary.
    """

    def part(points: NDArray[np.float64]) -> NDArray[np.float64]:
        order = np.argsort(points, kind="stable")
        sorted_points = points[order]
        sorted_weight = weight[order]
        cum_w = np.concatenate(([0.0], np.cumsum(sorted_weight)))
        cum_wp = np.concatenate(([0.0], np.cumsum(sorted_weight * sorted_points)))
        index = np.searchsorted(sorted_points, at, side="left")
        result: NDArray[np.float64] = at * cum_w[index] - cum_wp[index]
        return result

    return part(starts) - part(ends)


def windowed_percentiles(
    starts: NDArray[np.float64],
    ends: NDArray[np.float64],
    work: NDArray[np.float64],
    window: float = WINDOW_SECONDS,
) -> tuple[float, float] | None:
    """p10 and p50 of the throughput in consecutive windows of ``window`` seconds
    (``window_series``); ``None`` when fewer than ``MIN_WINDOWS`` windows count."""
    _, values = window_series(starts, ends, work, window)
    if values.size < MIN_WINDOWS:
        return None
    p10, p50 = np.percentile(values, [10.0, 50.0])
    return float(p10), float(p50)


def latency_percentiles(durations: NDArray[np.float64]) -> tuple[float, float, float]:
    """p50, p90 and p99 of per-iteration durations (seconds)."""
    p50, p90, p99 = np.percentile(durations, [50.0, 90.0, 99.0])
    return float(p50), float(p90), float(p99)
