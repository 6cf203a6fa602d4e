"""The outcome of one steady-state analysis, in the shape the archive, exporter and CLI share.

Every figure that cannot be stated (no steady state, no end times, too short a series) is
`None`, so a consumer never mistakes a placeholder for a measurement.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum


class Classification(StrEnum):
    """Barrett et al.'s (OOPSLA 2017) classes, plus `insufficient` for series too short to judge."""

    FLAT = "flat"
    WARMUP = "warmup"
    SLOWDOWN = "slowdown"
    NO_STEADY_STATE = "no_steady_state"
    INSUFFICIENT = "insufficient"


@dataclass(frozen=True, slots=True)
class SteadyStateResult:
    """Figures of one series; throughputs are in the unit of the input (work per second).

    Every throughput is delivered work over time (DESIGN.md, analysis step 4): `steady_throughput`
    is the total work of the steady regime over its total time, every iteration counted, with
    `steady_ci` its 99% circular-block-bootstrap interval (blocks of `bootstrap_block_iterations`);
    `peak_throughput` the best `peak_window_iterations` consecutive iterations by the same rule
    (never below the steady value); `sustained_ratio` steady over peak. `texture_period` is the
    period of a short repeating pattern the regimes were judged over (1: none).

    `steady_start_index` and `changepoints` are indices into the original series (outliers
    included), so they can be laid over the raw iterations. `warmup_seconds` is the time from the
    start of the run to the start of the steady regime, known only when end times were given.
    `warmup_throughput` is the work over time before the steady regime, given only for the
    `warmup` class.
    """

    classification: Classification
    n: int
    reason: str
    tolerance: float
    steady_start_index: int | None = None
    steady_throughput: float | None = None
    steady_ci: tuple[float, float] | None = None
    peak_throughput: float | None = None
    sustained_ratio: float | None = None
    changepoints: tuple[int, ...] = ()
    warmup_seconds: float | None = None
    mser5_index: int | None = None
    outliers: int = 0
    latency_p50_seconds: float | None = None
    latency_p90_seconds: float | None = None
    latency_p99_seconds: float | None = None
    warmup_throughput: float | None = None
    peak_window_iterations: int | None = None
    bootstrap_block_iterations: int | None = None
    texture_period: int = 1

    @property
    def has_steady_state(self) -> bool:
        return self.classification in (
            Classification.FLAT,
            Classification.WARMUP,
            Classification.SLOWDOWN,
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "classification": self.classification.value,
            "n": self.n,
            "steady_start_index": self.steady_start_index,
            "steady_throughput": self.steady_throughput,
            "steady_ci": list(self.steady_ci) if self.steady_ci is not None else None,
            "peak_throughput": self.peak_throughput,
            "sustained_ratio": self.sustained_ratio,
            "changepoints": list(self.changepoints),
            "warmup_seconds": self.warmup_seconds,
            "warmup_throughput": self.warmup_throughput,
            "peak_window_iterations": self.peak_window_iterations,
            "bootstrap_block_iterations": self.bootstrap_block_iterations,
            "texture_period": self.texture_period,
            "mser5_index": self.mser5_index,
            "outliers": self.outliers,
            "tolerance": self.tolerance,
            "latency_p50_seconds": self.latency_p50_seconds,
            "latency_p90_seconds": self.latency_p90_seconds,
            "latency_p99_seconds": self.latency_p99_seconds,
            "reason": self.reason,
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), allow_nan=False)
