"""What probing shows the rest of the agent: each probe's latest analysed result (what the gauges
hold until the next), its latest run whatever the outcome (what the landing page shows), and the
scheduler's state as one snapshot (``ProbeStatus``, taken by the exporter at each scrape).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agent.probes.analysis import RunAnalysis
from agent.probes.node import Coupling

ProbeKey = tuple[str, str, str, str, str]  # workload, precision, optimization, device, uuid


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """The latest analysed result of one probe, for the exporter."""

    unit: str
    work_unit: str
    analysis: RunAnalysis
    latency_seconds: dict[str, float] = field(default_factory=dict)  # p50, p90, p99 (inference)
    size: str = "default"  # the size the plan asked for (a coupling compares the same size)


@dataclass(frozen=True, slots=True)
class LatestRun:
    """The latest solo run of a probe that was not skipped, whatever its outcome: what the
    landing page shows, so that a run that gave no figures is never shown with an older run's.
    ``result`` is this run's own (None where it has none: it did not end ok, or its analysis
    failed)."""

    outcome: str
    reason: str
    started_at: float
    ended_at: float
    result: ProbeResult | None = None


@dataclass(frozen=True, slots=True)
class ProbeStatus:
    """What the exporter shows of probing."""

    runs: dict[tuple[str, str, str, str, str, str], int]  # ProbeKey + outcome
    last_run: dict[ProbeKey, float]
    running: dict[tuple[str, str], bool]
    duty_used: dict[tuple[str, str], float]
    results: dict[ProbeKey, ProbeResult]
    # Node-wide runs: each device's result and the node's (device "node"), and their coupling.
    node_results: dict[ProbeKey, ProbeResult] = field(default_factory=dict)
    coupling: dict[ProbeKey, Coupling] = field(default_factory=dict)
    # The latest solo run of each probe, with its own result or none (``results`` keeps the
    # latest analysed one, which the gauges hold until the next).
    latest: dict[ProbeKey, LatestRun] = field(default_factory=dict)
    # Skipped runs by why (ProbeKey + the kind of agent.probes.skips.SkipReason).
    skips: dict[tuple[str, str, str, str, str, str], int] = field(default_factory=dict)
