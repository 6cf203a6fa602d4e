"""Node-wide runs: which devices take part, the node's series, and the coupling ratio.

A node-wide run (a plan entry with ``scope = "node"``) runs the workload on every device of the
node at once, one child per device behind a start barrier (``ProbeRunner.run_group``). Each
device's series is analysed as a solo run's is; this module adds what only the group has:

- ``node_members``: the devices of a node-wide run. On a GPU node every probe device (whole GPUs
  and MIG devices); on a CPU node one member per NUMA node, each bound to that node's CPUs, from
  ``/sys/devices/system/node`` (one NUMA node: the run is the solo run, and is reported so).
- ``node_series``: the node as a whole, the sum of the devices' throughput on one time grid over
  the span in which every device was measuring, as iterations the steady-state analysis reads
  like any other run's (each device's work spread evenly over its iteration's interval).
- ``coupling``: per device, its node-wide throughput over its latest solo throughput of the same
  workload, precision, optimization and size, and for the node its sum over the sum of the solo
  figures: what the node loses when all of its devices work, as production runs them.

Pure Python: it runs in the daemon, whose memory budget has no room for numpy.
"""

from __future__ import annotations

import logging
import math
import re
import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.probes.analysis import RunAnalysis
from agent.probes.attribution import coupling_cause
from agent.probes.protocol import Iteration
from agent.probes.runner import ProbeDevice, ProbeRun, ProbeSpec
from agent.verdict import MIN_ITERATIONS

log = logging.getLogger(__name__)

NODE = "node"  # the label of the node as a whole (device="node", uuid="")
MAX_GRID_POINTS = 2000
# A coupling ratio below this is explained (the same causes as a slowdown, and host contention).
EXPLAIN_BELOW = 0.95
_NUMA_NODE = re.compile(r"node(\d+)")


def numa_nodes(sysfs: Path = Path("/sys")) -> dict[int, str]:
    """NUMA node id -> its CPUs (cpulist syntax), for the nodes that have CPUs; empty where
    the kernel does not say (no sysfs in the container: the CPU is then one device)."""
    found: dict[int, str] = {}
    try:
        entries = sorted((sysfs / "devices/system/node").iterdir())
    except OSError:
        return found
    for entry in entries:
        match = _NUMA_NODE.fullmatch(entry.name)
        if match is None:
            continue
        try:
            cpus = (entry / "cpulist").read_text().strip()
        except OSError:
            continue
        if cpus:
            found[int(match.group(1))] = cpus
    return found


def node_members(devices: Sequence[ProbeDevice], sysfs: Path = Path("/sys")) -> list[ProbeDevice]:
    """The devices a node-wide run starts a child on: every GPU probe device (MIG devices
    included), or on a CPU-only node one per NUMA node (``numa0``, ``numa1``: the CPU's
    telemetry, the node's CPUs)."""
    gpus = [device for device in devices if device.kind == "cuda" and not device.members]
    if gpus:
        return gpus
    cpu = next((device for device in devices if device.kind == "cpu"), None)
    if cpu is None:
        return []
    numa = numa_nodes(sysfs)
    if len(numa) < 2:
        return [cpu]
    return [
        ProbeDevice("cpu", cpu.key, f"numa{node}", node, cpus=cpus)
        for node, cpus in sorted(numa.items())
    ]


def analysed_phase(iterations: Sequence[Iteration]) -> list[Iteration]:
    """The iterations the analysis reads: those of the most frequent phase."""
    counts = Counter(iteration.phase for iteration in iterations)
    if not counts:
        return []
    phase = counts.most_common(1)[0][0]
    return [iteration for iteration in iterations if iteration.phase == phase]


def node_series(series: Sequence[Sequence[Iteration]]) -> list[Iteration]:
    """The node's throughput over time: every device's work summed on a common grid.

    The grid spans the time in which every device was measuring (from the latest first start to
    the earliest last end); it has as many points as the device with the fewest iterations in
    that span (at least ``MIN_ITERATIONS``, at most ``MAX_GRID_POINTS``). Each device runs at
    its iteration's rate (work over the iteration's own time) from the iteration's start to the
    next one's, so the short gaps between timed iterations (a cache flush, a line written) are
    not counted as idle: a point holds what the devices' own figures would say, summed. Empty
    when the devices' runs did not overlap."""
    runs = [analysed_phase(iterations) for iterations in series]
    if not runs or any(not run for run in runs):
        return []
    begin = max(run[0].start for run in runs)
    end = min(run[-1].end for run in runs)
    if end <= begin:
        return []
    inside = min(sum(1 for i in run if i.start >= begin and i.end <= end) for run in runs)
    points = min(max(inside, MIN_ITERATIONS), MAX_GRID_POINTS)
    width = (end - begin) / points
    work = [0.0] * points
    for run in runs:
        for iteration, following in zip(run, [*run[1:], None], strict=True):
            until = iteration.end if following is None else max(following.start, iteration.end)
            _spread(iteration, until, begin, end, width, work)
    return [
        Iteration(index, begin + index * width, begin + (index + 1) * width, amount)
        for index, amount in enumerate(work)
    ]


def _spread(  # noqa: PLR0917 - an iteration, its reach, and the grid
    iteration: Iteration, until: float, begin: float, end: float, width: float, work: list[float]
) -> None:
    """Add ``iteration``'s rate over [its start, ``until``) to the grid's points."""
    start, stop = max(iteration.start, begin), min(until, end)
    span = iteration.end - iteration.start
    if stop <= start or span <= 0:
        return
    first = min(int((start - begin) / width), len(work) - 1)
    last = min(math.ceil((stop - begin) / width), len(work))
    for point in range(first, last):
        low = begin + point * width
        overlap = min(stop, low + width) - max(start, low)
        if overlap > 0:
            work[point] += iteration.work * overlap / span


def figures(runs: Sequence[Mapping[str, Any]]) -> tuple[list[float], str] | None:
    """The figures a coupling ratio compares, the same statistic of every run: the steady figure
    where all of them found a steady state, else the median of their one-second windows (what
    they delivered); None where not every run has either. Never a steady figure against a
    median: under load the two differ by more than the loss being measured."""
    for name in ("steady", "p50"):
        values = [run.get(f"{name}_throughput") for run in runs]
        if all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in values):
            return [float(v) for v in values if v is not None], name
    return None


@dataclass(frozen=True, slots=True)
class Coupling:
    """One device's (or the node's) node-wide throughput against solo: ``ratio``, which figures
    it compared ("steady" or "p50" on either side), and for a ratio below ``EXPLAIN_BELOW`` the
    cause and the sentence that says why; ``low_runs`` counts consecutive node-wide runs below
    ``probing.coupling_threshold``."""

    ratio: float
    node_throughput: float
    solo_throughput: float
    compared: str
    cause: str | None
    reason: str
    low_runs: int = 0


def node_total(spec: ProbeSpec, group: str, runs: Sequence[ProbeRun]) -> ProbeRun:
    """The node as one run: the devices' series summed on a common grid (when every device
    ran to the end), its outcome the first that was not ok, in the members' order."""
    not_ok = [run for run in runs if run.outcome != "ok"]
    started = min((run.started_at for run in runs), default=time.time())
    ended = max((run.ended_at for run in runs), default=started)
    manifest = dict(runs[0].manifest or {}) if runs else {}
    if manifest:
        manifest["devices"] = [run.spec.device.title for run in runs]
    iterations = () if not_ok else tuple(node_series([run.iterations for run in runs]))
    if not_ok:
        outcome, reason = (
            not_ok[0].outcome,
            "; ".join(f"{run.spec.device.title}: {run.outcome}" for run in not_ok),
        )
    elif not iterations:
        outcome, reason = "failed", "the devices' measured runs did not overlap"
    else:
        outcome, reason = "ok", ""
    return ProbeRun(
        uuid.uuid4().hex,
        spec,
        outcome,
        reason,
        started,
        ended,
        manifest=manifest or None,
        iterations=iterations,
        preempted_by=next((run.preempted_by for run in runs if run.preempted_by), None),
        group=group,
    )


def coupling_of(
    analysis: RunAnalysis,
    solo: RunAnalysis,
    device_key: str,
    previous: Coupling | None,
    threshold: float,
) -> Coupling | None:
    """A device's node-wide run (``analysis``) against its solo run; explained below
    ``EXPLAIN_BELOW``. None where either run gave no figure to compare."""
    compared = figures([analysis.figures, solo.figures])
    if compared is None:
        return None
    (node_value, solo_value), kind = compared
    ratio = node_value / solo_value
    cause, reason = None, ""
    if ratio < EXPLAIN_BELOW:
        solo_segments = solo.attribution.segments
        node_segments = analysis.attribution.segments
        cause, reason = coupling_cause(
            solo_segments[-1] if solo_segments else None,
            node_segments[-1] if node_segments else None,
            ratio,
            device_key,
        )
    return Coupling(
        ratio,
        node_value,
        solo_value,
        kind,
        cause,
        reason,
        low_runs(ratio, previous, threshold),
    )


def low_runs(ratio: float, previous: Coupling | None, threshold: float) -> int:
    """Consecutive node-wide runs below ``threshold``, this one included."""
    if ratio >= threshold:
        return 0
    return 1 + (0 if previous is None else previous.low_runs)
