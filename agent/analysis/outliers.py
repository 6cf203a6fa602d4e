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


def inlier_mask(
    values: NDArray[np.float64], window: int = DEFAULT_WINDOW, k: float = DEFAULT_K
) -> NDArray[np.bool_]:
    """True for the points to keep. The window is centred and clamped at both ends of the series."""
    n = values.size
    w = min(window, n)
    if w < 3:
        return np.ones(n, dtype=np.bool_)
    starts = np.clip(np.arange(n) - w // 2, 0, n - w)
    # Windows only differ where the centre moves, so sort each distinct window once.
    unique_starts, inverse = np.unique(starts, return_inverse=True)
    windows = np.sort(np.lib.stride_tricks.sliding_window_view(values, w)[unique_starts], axis=1)
    median = windows[:, (w - 1) // 2] * 0.5 + windows[:, w // 2] * 0.5
    p10 = windows[:, int(0.1 * (w - 1))]
    p90 = windows[:, int(np.ceil(0.9 * (w - 1)))]
    band = k * (p90 - p10)
    deviation = np.abs(values - median[inverse])
    keep: NDArray[np.bool_] = deviation <= band[inverse]
    return keep
