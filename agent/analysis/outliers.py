"""Barrett et al.'s outlier rule, so that an isolated spike never becomes a segment of its own.

A point is an outlier when it lies outside median ± k·(p90 - p10) of the window of `window`
iterations around it. The spread of p10..p90 is wide enough to keep both sides of a genuine
step inside the band (the window straddling a step contains both levels), so only isolated
points are removed.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

DEFAULT_WINDOW = 200
DEFAULT_K = 3.0
EXACT_WINDOWS = 20_000
CHUNK = 2048  # windows sorted at once


def inlier_mask(
    values: NDArray[np.float64], window: int = DEFAULT_WINDOW, k: float = DEFAULT_K
) -> NDArray[np.bool_]:
    """True for the points to keep. The window is centred and clamped at both ends of the series."""
    n = values.size
    w = min(window, n)
    if w < 3:
        return np.ones(n, dtype=np.bool_)
    starts = np.clip(np.arange(n) - w // 2, 0, n - w)
    # Windows only differ where the centre moves; past `EXACT_WINDOWS` distinct windows the band
    # is taken from every `stride`-th one (it changes slowly: neighbours share all but a few
    # points), so a long run costs O(n) memory and a bounded number of sorts.
    stride = max(1, (n - w + 1) // EXACT_WINDOWS)
    unique_starts = np.arange(0, n - w + 1, stride)
    inverse = np.minimum((starts + stride // 2) // stride, unique_starts.size - 1)
    median = np.empty(unique_starts.size)
    band = np.empty(unique_starts.size)
    view = np.lib.stride_tricks.sliding_window_view(values, w)
    for first in range(0, unique_starts.size, CHUNK):
        windows = np.sort(view[unique_starts[first : first + CHUNK]], axis=1)
        median[first : first + CHUNK] = windows[:, (w - 1) // 2] * 0.5 + windows[:, w // 2] * 0.5
        p10 = windows[:, int(0.1 * (w - 1))]
        p90 = windows[:, int(np.ceil(0.9 * (w - 1)))]
        band[first : first + CHUNK] = k * (p90 - p10)
    deviation = np.abs(values - median[inverse])
    keep: NDArray[np.bool_] = deviation <= band[inverse]
    return keep
