"""Steady state versus peak for one probe's iteration series: pure functions, no I/O.

`analyze_work(work, seconds, end_times)` for iterations as work done and seconds taken,
`analyze(throughput, end_times, tolerance=0.02)` for a throughput series and
`analyze_durations(seconds_per_iteration)` for a duration series return a `SteadyStateResult`,
whose steady and peak figures are work over time.
"""

from agent.analysis.figures import latency_percentiles
from agent.analysis.result import Classification, SteadyStateResult
from agent.analysis.steady import (
    DEFAULT_TOLERANCE,
    InvalidSeriesError,
    analyze,
    analyze_durations,
    analyze_work,
)
from agent.verdict import MIN_ITERATIONS

__all__ = [
    "DEFAULT_TOLERANCE",
    "MIN_ITERATIONS",
    "Classification",
    "InvalidSeriesError",
    "SteadyStateResult",
    "analyze",
    "analyze_durations",
    "analyze_work",
    "latency_percentiles",
]
