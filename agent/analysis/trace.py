"""What a run plot draws besides the figures: the iterations of the phase the analysis decided on,
the ones it left out as outliers, and the throughput over one-second windows.

The figures (change points, steady start, peak, steady value and interval) are the analysis' own
(``python -m agent.analysis``); this module recomputes only what it does not hand back, with the
same functions, so the plot shows exactly what the verdict was made of.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from agent.analysis.figures import window_series
from agent.analysis.outliers import inlier_mask


@dataclass(frozen=True, slots=True)
class RunTrace:
    """Indices are the run's own iteration numbers; times are on the iterations' clock."""

    phase: str | None
    positions: tuple[int, ...]
    outliers: tuple[int, ...]
    window_starts: tuple[float, ...]
    window_throughput: tuple[float, ...]


def run_trace(
    iterations: Sequence[tuple[float, float, float, str | None]], phase: str | None = None
) -> RunTrace:
    """``iterations`` are (start, end, work, phase) in run order; ``phase`` the one analysed
    (default: the most frequent, as the analysis chooses)."""
    phases = [row[3] for row in iterations]
    if phase is None and phases:
        phase = Counter(phases).most_common(1)[0][0]
    positions = [index for index, name in enumerate(phases) if name == phase]
    if not positions:
        return RunTrace(phase, (), (), (), ())
    rows = np.array([iterations[index][:3] for index in positions], dtype=np.float64)
    starts, ends, work = rows[:, 0], rows[:, 1], rows[:, 2]
    keep = inlier_mask(work / (ends - starts))
    window_starts, values = window_series(starts, ends, work)
    return RunTrace(
        phase=phase,
        positions=tuple(positions),
        outliers=tuple(positions[int(index)] for index in np.flatnonzero(~keep)),
        window_starts=tuple(float(value) for value in window_starts),
        window_throughput=tuple(float(value) for value in values),
    )
