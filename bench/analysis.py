"""Time of one steady-state analysis for n = 1200 and n = 5000 (targets: 100 ms and 500 ms).

    .venv/bin/python bench/analysis.py

Series: a warm-up step at 10% of the run, 1% Student-t noise and 1% outliers, the shape of a
typical probe run. Prints a markdown table of the median of several runs, and as its last line
`RESULT {json}` for bench/run_all.py.
"""

from __future__ import annotations

import json
import math
import statistics
import time

import numpy as np
from numpy.typing import NDArray

from agent.analysis import analyze

TARGETS_MS = {1200: 100.0, 5000: 500.0}
RUNS = 9


def series(n: int, seed: int) -> NDArray[np.float64]:
    rng = np.random.default_rng(seed)
    base = np.ones(n)
    base[: n // 10] = 0.8
    values = 100.0 * base * (1.0 + 0.01 * np.clip(rng.standard_t(3, n), -15, 15) / math.sqrt(3))
    spikes = rng.random(n) < 0.01
    values[spikes] *= 0.5
    return values


def main() -> None:
    print("| n | median ms | min ms | max ms | target ms | classification |")
    print("|---|---|---|---|---|---|")
    figures = []
    for n, target in TARGETS_MS.items():
        times = []
        result = None
        for run in range(RUNS):
            values = series(n, run)
            start = time.perf_counter()
            result = analyze(values)
            times.append((time.perf_counter() - start) * 1000.0)
        assert result is not None
        print(
            f"| {n} | {statistics.median(times):.1f} | {min(times):.1f} | {max(times):.1f} "
            f"| {target:.0f} | {result.classification.value} |"
        )
        figures.append(
            {
                "n": n,
                "median_ms": statistics.median(times),
                "min_ms": min(times),
                "max_ms": max(times),
                "target_ms": target,
                "classification": result.classification.value,
            }
        )
    print("RESULT " + json.dumps({"runs": RUNS, "sizes": figures}, sort_keys=True))


if __name__ == "__main__":
    main()
