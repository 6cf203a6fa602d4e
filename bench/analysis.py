"""Time and peak memory of one probe run's analysis, as the agent runs it, from 1,200 to 360,000
iterations (an hour at 100 iterations/s). Targets: 100 ms at 1,200, 500 ms at 5,000, and 10 s with
300 MB peak RSS at 360,000 (issue 23).

    .venv/bin/python bench/analysis.py [--quick]

Each size runs in a fresh `python -m agent.analysis` child, as the daemon starts it: the child
reads the run's iterations as JSON on standard input and writes the figures back. The child's time
is its wall time (imports, parsing, analysis, windowed percentiles); the memory its peak resident
set (ru_maxrss of the finished child). "analysis s" is the analysis alone, in this process (the
targets at 1,200 and 5,000 are for it; the 360,000 target is for the whole child). Series:
back-to-back iterations of 10 ms with a warm-up step at 10% of the run, 1% Student-t noise, 1%
outliers and a 3x pause every 50 iterations. Prints a markdown table and, as its last line,
`RESULT {json}` for bench/run_all.py.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

from agent.analysis.__main__ import analyze_iterations

TARGETS = {
    1200: (100.0, None),
    5000: (500.0, None),
    50_000: (None, None),
    360_000: (10_000.0, 300.0),
}


def iterations(n: int, seed: int) -> list[list[float]]:
    rng = np.random.default_rng(seed)
    seconds = np.full(n, 0.01)
    seconds[: n // 10] *= 1.25
    seconds *= 1.0 + 0.01 * np.clip(rng.standard_t(3, n), -15, 15) / math.sqrt(3)
    seconds[rng.random(n) < 0.01] *= 2.0
    seconds[49::50] *= 3.0
    ends = np.cumsum(seconds)
    starts = ends - seconds
    return [[float(s), float(e), 1.0] for s, e in zip(starts, ends, strict=True)]


def run_child(document: bytes) -> tuple[float, float, dict[str, object]]:
    """Wall seconds, peak RSS in MB and the answer of one analysis child."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "agent.analysis"], input=document, capture_output=True, check=True
    )
    wall = time.perf_counter() - start
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # ru_maxrss of the children is the largest any child reached; the sizes only grow.
    return wall, max(peak_kb, before) / 1024.0, json.loads(done.stdout)


def in_process(rows: list[list[float]]) -> float:
    """Seconds of the analysis alone (no start-up, no JSON), as the tests and `analyze` see it."""
    start = time.perf_counter()
    analyze_iterations(rows, 0.02)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run per size instead of three")
    args = parser.parse_args()
    runs = 1 if args.quick else 3
    print(
        "| n | analysis s | child median s | child max s | child peak RSS MB | target s "
        "| target MB | classification | steady/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    figures = []
    for n, (target_ms, target_mb) in TARGETS.items():
        rows = iterations(n, 0)
        document = json.dumps({"iterations": rows, "tolerance": 0.02}).encode()
        analysis_s = min(in_process(rows) for _ in range(runs))
        del rows
        times, peaks = [], []
        answer: dict[str, object] = {}
        for _ in range(runs):
            wall, peak_mb, answer = run_child(document)
            times.append(wall)
            peaks.append(peak_mb)
        figure = {
            "n": n,
            "analysis_s": analysis_s,
            "median_s": statistics.median(times),
            "max_s": max(times),
            "peak_rss_mb": max(peaks),
            "target_s": None if target_ms is None else target_ms / 1000.0,
            "target_mb": target_mb,
            "classification": answer.get("classification"),
            "steady_throughput": answer.get("steady_throughput"),
        }
        figures.append(figure)
        print(
            f"| {n} | {analysis_s:.3f} | {figure['median_s']:.2f} | {figure['max_s']:.2f} "
            f"| {figure['peak_rss_mb']:.0f} "
            f"| {'' if target_ms is None else f'{target_ms / 1000:g}'} "
            f"| {'' if target_mb is None else f'{target_mb:g}'} "
            f"| {figure['classification']} | {figure['steady_throughput']} |"
        )
    print("RESULT " + json.dumps({"runs": runs, "sizes": figures}, sort_keys=True))


if __name__ == "__main__":
    main()
