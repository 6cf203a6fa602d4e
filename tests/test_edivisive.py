"""E-Divisive change points over a run history: steps found, noise and small steps left alone.

Series are per-run throughputs around 100 with Gaussian noise in % of the level; seeds are fixed,
so every run computes the same figures.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from numpy.typing import NDArray

from agent.analysis.edivisive import (
    ChangePoint,
    _best_split,
    _distance_prefix,
    change_points,
)

LEVEL = 100.0


def series(
    n: int,
    steps: dict[int, float],
    noise: float,
    seed: int,
    noise_until: tuple[int, float] | None = None,
) -> NDArray[np.float64]:
    """`n` runs at LEVEL, multiplied by (1 + rel) from each index in `steps` on, with noise.

    `noise_until` = (index, noise) gives the runs before `index` a different noise level.
    """
    rng = np.random.default_rng(seed)
    level = np.full(n, LEVEL)
    for index, rel in steps.items():
        level[index:] *= 1.0 + rel
    sigma = np.full(n, noise)
    if noise_until is not None:
        sigma[: noise_until[0]] = noise_until[1]
    return level * (1.0 + sigma * rng.standard_normal(n))


def indices(points: list[ChangePoint]) -> list[int]:
    return [p.index for p in points]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_single_regression_is_found_at_its_index(seed: int) -> None:
    x = series(120, {60: -0.08}, 0.01, seed)
    points = change_points(x.tolist())
    assert len(points) == 1
    (point,) = points
    assert abs(point.index - 60) <= 2
    assert point.relative_change == pytest.approx(-0.08, abs=0.01)
    assert point.pvalue < 0.001
    # The means are those of the whole neighbouring segments.
    assert point.mean_before == pytest.approx(float(np.mean(x[: point.index])))
    assert point.mean_after == pytest.approx(float(np.mean(x[point.index :])))


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_regression_then_improvement_are_both_found(seed: int) -> None:
    x = series(200, {70: -0.08, 140: 0.14}, 0.01, seed)
    points = change_points(x.tolist())
    assert len(points) == 2
    first, second = points
    assert abs(first.index - 70) <= 2
    assert abs(second.index - 140) <= 2
    assert first.relative_change == pytest.approx(-0.08, abs=0.01)
    assert second.relative_change == pytest.approx(0.14, abs=0.015)
    # The segment between them is shared: after the first is before the second.
    assert first.mean_after == second.mean_before


@pytest.mark.parametrize("seed", range(10, 20))
def test_pure_noise_has_no_change_points(seed: int) -> None:
    x = series(200, {}, 0.01, seed)
    assert change_points(x.tolist()) == []


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_change_below_min_magnitude_is_dropped_and_kept_when_allowed(seed: int) -> None:
    # 1% step on 0.1% noise: overwhelmingly significant, but small.
    x = series(120, {60: 0.01}, 0.001, seed)
    assert change_points(x.tolist(), min_magnitude=0.03) == []
    points = change_points(x.tolist(), min_magnitude=0.005)
    assert indices(points) == [60]
    assert points[0].relative_change == pytest.approx(0.01, abs=0.002)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_change_in_the_last_runs_of_a_long_history_is_found(seed: int) -> None:
    x = series(300, {285: -0.08}, 0.01, seed)
    points = change_points(x.tolist())
    assert len(points) == 1
    assert abs(points[0].index - 285) <= 2
    assert points[0].relative_change == pytest.approx(-0.08, abs=0.01)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_windows_keep_old_history_from_masking_a_new_change(seed: int) -> None:
    # The first 200 runs were noisy (5%), the recent ones are quiet (0.5%), and the last 15
    # dropped by 5%. On the whole history, the strongest q-hat split is the change in noise at
    # 200, which no t-test on the means confirms, so E-Divisive stops before it reaches 285.
    x = series(300, {285: -0.05}, 0.005, seed, noise_until=(200, 0.05))
    points = change_points(x.tolist())
    assert len(points) == 1
    assert abs(points[0].index - 285) <= 2
    assert points[0].relative_change == pytest.approx(-0.05, abs=0.01)
    # One window over everything (the first would reach the end, so no second one) misses it.
    assert change_points(x.tolist(), window=2 * x.size) == []


def test_result_does_not_depend_on_the_unit() -> None:
    x = series(200, {70: -0.08, 140: 0.14}, 0.01, 4)
    in_units = change_points(x.tolist())
    in_flops = change_points((x * 1e12).tolist())
    assert indices(in_flops) == indices(in_units)
    for a, b in zip(in_flops, in_units, strict=True):
        assert a.relative_change == pytest.approx(b.relative_change, rel=1e-9)
        assert a.pvalue == pytest.approx(b.pvalue, rel=1e-6, abs=1e-300)


@pytest.mark.parametrize("value", [100.0, 0.1, 0.0, 3.7e14])
def test_constant_series_has_no_change_points(value: float) -> None:
    # Zero variance everywhere: no t-test division (the module runs under -W error).
    assert change_points([value] * 150) == []


def test_noise_free_step_is_found_without_division_warnings() -> None:
    points = change_points([10.0] * 30 + [9.0] * 30)
    assert indices(points) == [30]
    assert points[0].pvalue == 0.0
    assert points[0].relative_change == pytest.approx(-0.1)


@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_short_series_has_no_change_points(n: int) -> None:
    assert change_points([100.0, 50.0, 100.0][:n]) == []


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_rejected(bad: float) -> None:
    values = [100.0] * 40
    values[17] = bad
    with pytest.raises(ValueError, match=r"finite.*index 17"):
        change_points(values)
    # Even where the series is too short to analyse.
    with pytest.raises(ValueError, match="finite"):
        change_points([bad])


@pytest.mark.parametrize(
    "kwargs",
    [{"window": 3}, {"max_pvalue": 0.0}, {"max_pvalue": 1.5}, {"min_magnitude": -0.1}],
)
def test_parameters_out_of_range_are_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        change_points([100.0] * 40, **kwargs)  # type: ignore[arg-type]


def test_relative_change_is_zero_without_a_before_level() -> None:
    assert ChangePoint(index=5, mean_before=0.0, mean_after=3.0, pvalue=0.0).relative_change == 0.0
    point = ChangePoint(index=5, mean_before=100.0, mean_after=92.0, pvalue=0.0)
    assert point.relative_change == pytest.approx(-0.08)


def naive_qhat(z: NDArray[np.float64], a: int, tau: int, kappa: int) -> float:
    """q-hat of Matteson & James straight from the definition, pair by pair."""
    x, y = z[a:tau], z[tau:kappa]
    m, k = x.size, y.size
    cross = sum(abs(p - q) for p in x for q in y)
    within_x = sum(abs(p - q) for p, q in itertools.combinations(x, 2))
    within_y = sum(abs(p - q) for p, q in itertools.combinations(y, 2))
    energy = 2.0 * cross / (m * k) - within_x / math.comb(m, 2) - within_y / math.comb(k, 2)
    return float(m * k / (m + k) * energy)


@pytest.mark.parametrize(("a", "b"), [(0, 23), (5, 23), (9, 14)])
def test_prefix_sum_qhat_matches_the_definition(a: int, b: int) -> None:
    z = np.random.default_rng(42).standard_normal(23)
    z[12:] += 1.5
    best = max(
        (naive_qhat(z, a, tau, kappa), tau)
        for tau in range(a + 2, b - 1)
        for kappa in range(tau + 2, b + 1)
    )
    qhat, tau = _best_split(_distance_prefix(z), a, b)
    assert tau == best[1]
    assert qhat == pytest.approx(best[0], rel=1e-9)
