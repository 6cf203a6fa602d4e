"""MSER-5, the simulation literature's truncation rule, as a second opinion on where warm-up ends.

It only minimises the standard error of the remaining mean, so it knows nothing of slowdowns or
oscillations; it is reported next to the change-point answer and never decides the class.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

BATCH = 5


def mser5(values: NDArray[np.float64]) -> int | None:
    """Index of the first iteration kept by MSER-5, or None when there are fewer than 2 batches.

    Truncation is searched over the first half of the batches, as White (1997) recommends, so a
    late change cannot make the rule discard most of the run.
    """
    batches = values.size // BATCH
    if batches < 2:
        return None
    means = values[: batches * BATCH].reshape(batches, BATCH).mean(axis=1)
    # For every truncation d: sum over i >= d of (Y_i - mean_d)^2 / (b - d)^2, from suffix sums.
    suffix = np.cumsum(means[::-1])[::-1]
    suffix2 = np.cumsum((means * means)[::-1])[::-1]
    remaining = np.arange(batches, 0, -1, dtype=np.float64)
    sse = suffix2 - suffix * suffix / remaining
    score = sse / (remaining * remaining)
    limit = max(1, batches // 2)
    return int(np.argmin(score[:limit])) * BATCH
