"""Change points in a run-to-run history: E-Divisive means with a t-test, windowed, then merged.

The input is one value per probe run (the steady throughput of each run, typically 20-300 runs),
and the question is at which runs the level moved. The method is the one Apache Otava (formerly
Hunter) uses for performance histories (Fleming et al., "Hunter: Using Change Point Detection to
Hunt for Performance Regressions", ICPE 2023):

1. Split. E-Divisive means (Matteson & James, JASA 2014) proposes the split of an interval that
   maximises the energy-distance statistic q-hat (|x - y| distances, power 1). Instead of the
   permutation test of the original, a two-sided Student t-test between the two sides of the
   interval decides whether the split stands; it is deterministic, cheap, and holds for the tiny
   segments a history has. Splitting recurses into the resulting intervals until the strongest
   remaining candidate fails the test. The series is processed in overlapping windows of `window`
   points (each starting half a window later, or at the last change found), because on the whole
   history a long stable past dwarfs a recent change in q-hat and masks it. The windows use a
   relaxed threshold (10x `max_pvalue`, as Otava does), so they yield "weak" change points.
2. Merge. Each weak change point is tested between its neighbouring segments (bounded by the
   adjacent change points); while any has p > `max_pvalue` or a magnitude below
   `min_magnitude`, the weakest one (largest p-value first, else smallest magnitude) is removed
   and its neighbours are tested again. One at a time, because a removal lengthens the segments
   of the neighbours: a real change that looked weak next to a spurious one passes once that
   one is gone, and is not thrown out with it.

This is our own small implementation, written from the papers, not from either code base: the
`apache-otava` package pins numpy==2.2.0 exactly and pulls google-cloud-bigquery, slack-sdk and
pg8000, and MongoDB's signal-processing-algorithms requires Python ~3.11 only, numpy<2 and gevent.
It differs from Otava in two small ways: segments proposed by q-hat have at least `MIN_SEGMENT`
points (the within-segment mean distance of a single point is undefined, and treating it as 0
biases q-hat towards splitting off the first or last point of every window), and the t-test is
given sample standard deviations (ddof=1), which is what `ttest_ind_from_stats` expects.

q-hat for every split tau and every end kappa of an interval comes from one 2-D prefix sum of
the window's distance matrix, so an interval costs O(n^2) numpy work and a 300-run history takes
a few milliseconds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from scipy import stats  # type: ignore[import-untyped]

DEFAULT_WINDOW = 50
DEFAULT_MAX_PVALUE = 0.001
DEFAULT_MIN_MAGNITUDE = 0.03
MIN_SEGMENT = 2  # points on each side of a split proposed by q-hat
MIN_VALUES = 2 * MIN_SEGMENT  # shorter series (and windows) cannot be split
SAME_MEAN_RTOL = 1e-12  # means this close are one level: summation rounding, not a change


@dataclass(frozen=True, slots=True)
class ChangePoint:
    """A change in level: `index` is the first run of the new segment.

    The means are those of the whole neighbouring segments (from the previous change point, or
    the start, to the next change point, or the end), and `pvalue` is the two-sided t-test
    between them, as left by the merge step.
    """

    index: int
    mean_before: float
    mean_after: float
    pvalue: float

    @property
    def relative_change(self) -> float:
        """mean_after / mean_before - 1: negative for a drop in throughput (0.0 if undefined)."""
        if self.mean_before == 0.0:
            return 0.0
        return self.mean_after / self.mean_before - 1.0


@dataclass(frozen=True, slots=True)
class _Comparison:
    """The two sides of one change point: their means and the t-test p-value between them."""

    mean_before: float
    mean_after: float
    pvalue: float

    @property
    def magnitude(self) -> float:
        """Larger of the forward and backward relative change, as Otava measures a change.

        Symmetric in the direction: a drop from 100 to 50 and a rise from 50 to 100 both count
        as 1.0, so a regression is not judged smaller than the improvement that undoes it.
        """
        forward = self.mean_after / self.mean_before - 1.0 if self.mean_before != 0.0 else 0.0
        backward = self.mean_before / self.mean_after - 1.0 if self.mean_after != 0.0 else 0.0
        return max(abs(forward), abs(backward))


def change_points(
    values: Sequence[float],
    *,
    window: int = DEFAULT_WINDOW,
    max_pvalue: float = DEFAULT_MAX_PVALUE,
    min_magnitude: float = DEFAULT_MIN_MAGNITUDE,
) -> list[ChangePoint]:
    """Change points of a history of per-run values, sorted by index.

    `window` is the number of runs E-Divisive sees at once, `max_pvalue` the significance a
    change point must reach against its neighbouring segments, and `min_magnitude` the relative
    change it must reach (0.03: a 3% step). Fewer than `MIN_VALUES` values give no change points.
    Raises ValueError for values that are not finite and for parameters out of range.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"values must be a one-dimensional sequence, got shape {x.shape}")
    bad = np.flatnonzero(~np.isfinite(x))
    if bad.size:
        raise ValueError(
            f"values must be finite: {bad.size} NaN or infinite value(s), first at index {bad[0]}"
        )
    if window < MIN_VALUES:
        raise ValueError(f"window must be at least {MIN_VALUES}, got {window}")
    if not 0.0 < max_pvalue <= 1.0:
        raise ValueError(f"max_pvalue must be in (0, 1], got {max_pvalue}")
    if not min_magnitude >= 0.0:
        raise ValueError(f"min_magnitude must be >= 0, got {min_magnitude}")
    if x.size < MIN_VALUES:
        return []
    weak = _split(x, window, _first_pass_pvalue(max_pvalue))
    return _merge(x, weak, max_pvalue, min_magnitude)


def _first_pass_pvalue(max_pvalue: float) -> float:
    """Relaxed threshold of the split step (Otava's rule): the merge step applies the real one.

    A window sees only part of a segment, so a true change can look weaker there than it is on
    the whole history; a looser first pass keeps it as a candidate for the merge to judge.
    """
    if max_pvalue < 0.05:
        return max_pvalue * 10.0
    if max_pvalue < 0.5:
        return max_pvalue * 2.0
    return max_pvalue


def _split(x: NDArray[np.float64], window: int, pvalue: float) -> list[int]:
    """Weak change points: E-Divisive over overlapping windows, united, sorted.

    Each window starts half a window after the previous one, or at the last change point the
    previous one found if that is later, so that a window never straddles an old change and the
    one after it with the old change dominating q-hat.
    """
    n = x.size
    step = window // 2
    # q-hat is invariant to shift and scale; distances of order 1 keep the prefix sums exact
    # enough whatever the unit (FLOP/s reach 1e15).
    centre = float(np.median(x))
    spread = float(np.max(np.abs(x - centre)))
    z = (x - centre) / spread if spread > 0.0 else x - centre
    found: set[int] = set()
    start = 0
    while start < n:
        end = min(start + window, n)
        new = _edivisive(x[start:end], z[start:end], pvalue) if end - start >= MIN_VALUES else []
        found.update(start + i for i in new)
        start = max(start + new[-1] if new else 0, start + step)
    return sorted(found)


def _edivisive(x: NDArray[np.float64], z: NDArray[np.float64], pvalue: float) -> list[int]:
    """Change points of one window (`x` raw, `z` normalised): E-Divisive with a t-test.

    Each round, every interval between the change points found so far proposes its q-hat
    maximising split; the strongest proposal over all intervals is tested between the two sides
    of its interval, and the first one that fails ends the search (as in Matteson & James,
    where the candidate with the largest q-hat is the one tested).
    """
    prefix = _distance_prefix(z)
    bounds = [0, x.size]
    proposals: dict[tuple[int, int], tuple[float, int]] = {}
    while True:
        best: tuple[float, int, int, int] | None = None
        for a, b in itertools.pairwise(bounds):
            if b - a < MIN_VALUES:
                continue
            if (a, b) not in proposals:
                proposals[(a, b)] = _best_split(prefix, a, b)
            qhat, tau = proposals[(a, b)]
            if best is None or qhat > best[0]:
                best = (qhat, a, tau, b)
        if best is None:
            break
        _, a, tau, b = best
        if _compare(x, a, tau, b).pvalue > pvalue:
            break
        bounds = sorted([*bounds, tau])
    return bounds[1:-1]


def _distance_prefix(z: NDArray[np.float64]) -> NDArray[np.float64]:
    """P[i, j] = sum of |z_r - z_c| over r < i, c < j: any block sum in four lookups."""
    n = z.size
    prefix = np.zeros((n + 1, n + 1))
    prefix[1:, 1:] = np.abs(z[:, None] - z[None, :]).cumsum(axis=0).cumsum(axis=1)
    return prefix


def _best_split(prefix: NDArray[np.float64], a: int, b: int) -> tuple[float, int]:
    """(q-hat, tau) maximising q-hat over splits tau and ends kappa of the interval [a, b).

    For X = z[a:tau] (m points) and Y = z[tau:kappa] (k points), with sums of distances
    S_XY across and S_XX, S_YY within (each pair counted twice),

        q-hat = m k / (m + k) * (2 S_XY / (m k) - S_XX / (m (m - 1)) - S_YY / (k (k - 1))),

    the scaled sample energy distance of Matteson & James with U-statistic within-terms. Every
    sum is a block of the prefix matrix; all (tau, kappa) pairs are evaluated at once.
    """
    taus = np.arange(a + MIN_SEGMENT, b - MIN_SEGMENT + 1)[:, None]
    kappas = np.arange(a + 2 * MIN_SEGMENT, b + 1)[None, :]
    valid = kappas - taus >= MIN_SEGMENT
    m = (taus - a).astype(np.float64)
    k = np.where(valid, kappas - taus, MIN_SEGMENT).astype(np.float64)
    p = prefix
    p_tt = p[taus, taus]
    p_at = p[a, taus]
    p_tk = p[taus, kappas]
    cross = p_tk - p[a, kappas] - p_tt + p_at
    within_x = p_tt - 2.0 * p_at + p[a, a]
    within_y = p[kappas, kappas] - 2.0 * p_tk + p_tt
    energy = 2.0 * cross / (m * k) - within_x / (m * (m - 1.0)) - within_y / (k * (k - 1.0))
    qhat = np.where(valid, m * k / (m + k) * energy, -np.inf)
    i, _ = np.unravel_index(int(np.argmax(qhat)), qhat.shape)
    return float(qhat[i].max()), a + MIN_SEGMENT + int(i)


def _compare(x: NDArray[np.float64], a: int, t: int, b: int) -> _Comparison:
    """Two-sided Student t-test between x[a:t] and x[t:b], degenerate cases decided directly.

    scipy divides by the pooled standard deviation, which is 0 for flat segments (a constant
    series, a quantised metric); there the means alone decide, without a division warning.
    """
    left, right = x[a:t], x[t:b]
    mean_1, mean_2 = float(np.mean(left)), float(np.mean(right))
    n_1, n_2 = left.size, right.size
    std_1 = float(np.std(left, ddof=1)) if n_1 > 1 else 0.0
    std_2 = float(np.std(right, ddof=1)) if n_2 > 1 else 0.0
    if n_1 + n_2 <= 2 or math.isclose(mean_1, mean_2, rel_tol=SAME_MEAN_RTOL, abs_tol=0.0):
        pvalue = 1.0
    elif std_1 == 0.0 and std_2 == 0.0:
        pvalue = 0.0
    else:
        result = stats.ttest_ind_from_stats(mean_1, std_1, n_1, mean_2, std_2, n_2)
        pvalue = float(result.pvalue)
    return _Comparison(mean_before=mean_1, mean_after=mean_2, pvalue=pvalue)


def _merge(
    x: NDArray[np.float64], weak: list[int], max_pvalue: float, min_magnitude: float
) -> list[ChangePoint]:
    """Hunter's merge step: drop the weakest change point until all pass, retesting neighbours.

    The p-value goes first: a change point that is not significant is removed even if its
    magnitude is large (a short noisy segment). Only the two change points next to a removed
    one see new segments, so only they are tested again.
    """
    points = list(weak)
    bounds = [0, *points, x.size]
    tests = [_compare(x, bounds[i], bounds[i + 1], bounds[i + 2]) for i in range(len(points))]
    while points:
        worst = max(range(len(points)), key=lambda i: tests[i].pvalue)
        if tests[worst].pvalue <= max_pvalue:
            worst = min(range(len(points)), key=lambda i: tests[i].magnitude)
            if tests[worst].magnitude >= min_magnitude:
                break
        del points[worst], tests[worst]
        bounds = [0, *points, x.size]
        for i in (worst - 1, worst):
            if 0 <= i < len(points):
                tests[i] = _compare(x, bounds[i], bounds[i + 1], bounds[i + 2])
    return [
        ChangePoint(
            index=index, mean_before=t.mean_before, mean_after=t.mean_after, pvalue=t.pvalue
        )
        for index, t in zip(points, tests, strict=True)
    ]
