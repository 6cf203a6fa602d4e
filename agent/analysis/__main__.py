"""``python -m agent.analysis``: analyse one probe run in a process of its own.

The daemon never imports numpy or scipy (they alone would double its memory), so it hands a
finished run's iterations to this short-lived child as JSON on standard input::

    {"iterations": [[start, end, work, phase], ...], "tolerance": 0.02}

and reads one JSON object back: the analysis of the iterations' work and times (steady and peak
are work over time, docs/design.md), with ``"phase"`` naming the phase analysed and
``p10_throughput``/``p50_throughput`` the percentiles of that phase's throughput over one-second
windows (``None`` below three). A run with phases (inference: prefill and decode; membw: copy and
triad) is analysed on its most frequent phase, whose iterations are like one another. Bad input:
one line on standard error, exit 2.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any

import numpy as np

from agent.analysis import InvalidSeriesError
from agent.analysis.figures import WINDOW_SECONDS, windowed_percentiles
from agent.analysis.steady import analyze_work


def analyze_iterations(iterations: list[list[Any]], tolerance: float) -> dict[str, Any]:
    phases = [row[3] if len(row) > 3 else None for row in iterations]
    phase = Counter(phases).most_common(1)[0][0] if phases else None
    positions = np.array([index for index, name in enumerate(phases) if name == phase], dtype=int)
    table = np.array([[float(value) for value in row[:3]] for row in iterations]).reshape(-1, 3)
    chosen = table[positions]
    starts, ends, work = chosen[:, 0], chosen[:, 1], chosen[:, 2]
    first = float(starts[0]) if starts.size else 0.0
    analysis = analyze_work(work, ends - starts, ends - first, tolerance=tolerance)
    result = analysis.as_dict()
    # Indices into the chosen phase's iterations, mapped back to the run's own numbering.
    start = analysis.steady_start_index
    result["steady_start_index"] = None if start is None else int(positions[start])
    result["changepoints"] = [
        int(positions[i]) for i in analysis.changepoints if i < positions.size
    ]
    result["phase"] = phase
    windowed = windowed_percentiles(starts, ends, work)
    result["p10_throughput"] = None if windowed is None else windowed[0]
    result["p50_throughput"] = None if windowed is None else windowed[1]
    result["window_seconds"] = WINDOW_SECONDS
    return result


def main() -> int:
    try:
        request = json.load(sys.stdin)
        iterations = request["iterations"]
        tolerance = float(request.get("tolerance", 0.02))
        if any(float(row[1]) <= float(row[0]) for row in iterations):
            raise InvalidSeriesError("an iteration ends before it starts")
        result = analyze_iterations(iterations, tolerance)
    except (ValueError, KeyError, TypeError, IndexError) as exc:  # InvalidSeriesError is one
        print(f"agent.analysis: bad input: {exc}", file=sys.stderr)
        return 2
    json.dump(result, sys.stdout, allow_nan=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
