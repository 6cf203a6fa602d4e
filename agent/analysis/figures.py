"""Peak, steady value with its confidence interval, and latency percentiles.

Peak is the best short window rather than the best single iteration, so that one lucky
iteration does not set the reference the sustained ratio is measured against.
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


def latency_percentiles(durations: NDArray[np.float64]) -> tuple[float, float, float]:
    """p50, p90 and p99 of per-iteration durations (seconds)."""
    p50, p90, p99 = np.percentile(durations, [50.0, 90.0, 99.0])
    return float(p50), float(p90), float(p99)
