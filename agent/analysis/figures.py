"""Peak, steady value with its confidence interval, windowed percentiles, latency percentiles.

Peak is the best short window rather than the best single iteration, so that one lucky
iteration does not set the reference the sustained ratio is measured against. The windowed
percentiles exist for the run that never settles: it has no steady value, yet its p10 over
one-second windows still tells a planner what it delivered at worst.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

PEAK_WINDOW_FRACTION = 0.05
PEAK_MIN_WINDOW = 5
BOOTSTRAP_RESAMPLES = 1000
CONFIDENCE = 0.99


def peak(values: NDArray[np.float64]) -> float:
    """Maximum rolling mean over 5% of the series (at least 5 iterations)."""
    w = max(PEAK_MIN_WINDOW, round(PEAK_WINDOW_FRACTION * values.size))
    if values.size <= w:
        return float(np.mean(values))
    cs = np.concatenate(([0.0], np.cumsum(values)))
    return float(np.max(cs[w:] - cs[:-w]) / w)


def bootstrap_mean_ci(
    segments: Sequence[NDArray[np.float64]], seed: int = 0, resamples: int = BOOTSTRAP_RESAMPLES
) -> tuple[float, float]:
    """99% percentile interval of the mean, resampling within each segment.

    Resampling within segments keeps each segment's share of the steady region fixed, so the
    interval reflects noise, not a reshuffling of levels that PELT already told apart. The seed
    is fixed so the same series always yields the same interval.
    """
    rng = np.random.default_rng(seed)
    total = np.zeros(resamples)
    count = 0
    for segment in segments:
        size = segment.size
        if size == 0:
            continue
        picks = rng.integers(0, size, size=(resamples, size))
        total += segment[picks].sum(axis=1)
        count += size
    means = total / max(count, 1)
    tail = (1.0 - CONFIDENCE) / 2.0 * 100.0
    low, high = np.percentile(means, [tail, 100.0 - tail])
    return float(low), float(high)


WINDOW_SECONDS = 1.0
MIN_WINDOWS = 3


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
    between iterations (another phase, the timer's own work) is not charged as idle.
    """
    empty = np.zeros(0)
    if starts.size == 0:
        return empty, empty
    origin = float(starts.min())
    count = int((float(ends.max()) - origin) // window)
    if count < 1:
        return empty, empty
    done = np.zeros(count)
    busy = np.zeros(count)
    rate = work / (ends - starts)
    edges = origin + window * np.arange(count + 1)
    for index in range(count):
        overlap = np.clip(
            np.minimum(ends, edges[index + 1]) - np.maximum(starts, edges[index]), 0.0, None
        )
        done[index] = float(np.sum(overlap * rate))
        busy[index] = float(np.sum(overlap))
    kept = busy > 0
    values: NDArray[np.float64] = (done[kept] / busy[kept]).astype(np.float64)
    window_starts: NDArray[np.float64] = edges[:-1][kept].astype(np.float64)
    return window_starts, values


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
