"""Before the manifest: a problem size that fits the minimum of iterations in the duration, and,
for a precision the device lacks natively, how it compares with the native ones.

The agent's analysis decides nothing on fewer than its minimum of iterations, so a run of one
53 s iteration in a 2 s probe (bf16 matmul on a CPU without native bf16) measures nothing usable.
When the agent passes that minimum (``--min-iterations``), a workload that can shrink its problem
(``Workload.max_shrink``) is sized here: trial steps climb from the smallest problem towards the
default one. A size's step time is a conservative estimate of a sustained one: the slower of
the timed trial steps, times ``MARGIN``, since the run's iterations are slower than cold trial
steps (a GPU under its power cap, a CPU's turbo and neighbours: 0.2175 s as the fastest trial
step of a 2048^3 fp32 matmul on the 2-core development machine, 0.261 s in the run that
followed). The default size is kept whenever that estimate fits the duration's share of one
iteration (duration / minimum); a smaller one is chosen with room to spare (half that share), so
that warm-up and noise do not push the run under the minimum. A bigger size is tried only while
the last one's time, scaled by the work, predicts less than ``REACH`` times the limit: small
problems carry fixed costs (a thread barrier on a busy CPU costs as much as a 128^3 matmul), so a
prediction from them overstates the bigger ones, while a slow path scales with the work and is
stopped before it costs seconds. A trial whose first step is already over the limit ends there.
Every trial is taken before the manifest, so it counts as start-up, not as part of the measured
run.

Sustained iterations can still turn out slower than any trial (a power cap that engages once the
run starts, a neighbour that starts beside it), so the run checks the size again (``replan``):
after its first ``CHECK_ITERATIONS`` iterations at a size, or that many shares of the duration
where sooner, the pace so far must reach the minimum by the run's deadline; where it does not,
the problem shrinks one level and its series starts again (workloads/runner.py).

A precision the device has no native support for is then compared with every native precision
of the same workload, each sized as the workload's default probe (its default duration) or this
run, whichever allows the bigger problem: what the device's best precision achieves, against
what this one achieves in this run. More than 20x slower than the best of them is a slow path,
recorded in the manifest for the agent to report ("bf16 on this CPU has no native support (...):
0.004 of fp32").

The default GPU problem that sizing starts from is chosen by one rule for matmul and attention
(``memory_class``), from the total memory the device reports. That figure sits under the
marketed size: 0.5-2% (an A100 40GB reports 39.4-39.6 GiB, an H100 80GB 79.1-79.6 GiB), about 6%
with ECC on GDDR memory. A threshold at a marketed size (the 40 GiB it was) therefore splits a
class of devices by a rounding, so the one threshold lies between marketed sizes: 36 GiB, 4 GiB
from the 32 GB and the 40 GB devices. "large": the 40 GB A100 and everything bigger (48, 80, 94,
141 GB); "medium": the 32 GB V100 and everything smaller. The class and the figure it was taken
from go into the manifest's parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, Literal

from workloads import precision as precisions
from workloads.device import DeviceInfo
from workloads.timer import Timer
from workloads.workload import Record, Request, Workload

SPARE: Final = 0.5
"""A shrunk problem's step takes at most this share of the duration's share of one iteration."""
REACH: Final = 4.0
SLOW_PATH_RATIO: Final = 1 / 20
TRIAL_STEPS: Final = 2
"""Timed trial steps per size (after one untimed: first calls choose kernels and allocate)."""
MARGIN: Final = 1.25
"""A size's sustained step is estimated as its slower timed trial step times this."""
CHECK_ITERATIONS: Final = 3
"""In the run: iterations at a size (or that many shares of the duration) before its pace is
checked against the minimum."""
TICK_SECONDS: Final = 1e-9  # a step timed at zero (below the clock's resolution) divides by this
LARGE_MEMORY_BYTES: Final = 36 << 30
"""The memory class threshold: between the 32 GB and 40 GB devices, far from either."""


@dataclass(frozen=True, slots=True)
class MemoryClass:
    """Which default GPU problem a device gets, and the total memory that decided it."""

    name: Literal["large", "medium"]
    memory_total_bytes: int | None

    @property
    def parameters(self) -> dict[str, Any]:
        """The decision as the manifest's parameters record it."""
        return {"memory_class": self.name, "memory_total_bytes": self.memory_total_bytes}


def memory_class(device: DeviceInfo) -> MemoryClass:
    """Class "large" from ``LARGE_MEMORY_BYTES`` of total memory; "medium" below it, or where the
    device does not say."""
    total = device.memory_total_bytes
    large = total is not None and total >= LARGE_MEMORY_BYTES
    return MemoryClass("large" if large else "medium", total)


@dataclass(slots=True)
class Calibrated:
    """The workload to run and what the manifest records of how it was chosen."""

    workload: Workload
    fit: dict[str, Any] | None = None
    reference: dict[str, Any] | None = None
    slow_path: str | None = None


def calibrate(
    workload_class: type[Workload],
    request: Request,
    device: DeviceInfo,
    timer: Timer,
    *,
    duration: float,
    min_iterations: int | None,
    neighbours: int = 0,
) -> Calibrated:
    """Build the workload at the size that fits; as asked where no minimum is given or the
    workload cannot shrink. With ``neighbours`` (the other children of a node-wide run), the
    problem is sized for ``neighbours + 1`` times the minimum: a child that sizes while its
    neighbours are still starting, or already wait at the start barrier, sizes alone, and is
    then measured beside them (on shared CPUs, half as fast with one neighbour)."""
    if min_iterations is None or workload_class.max_shrink == 0:
        return Calibrated(workload_class(request, device))
    share = duration / (min_iterations * (neighbours + 1))
    workload, _, fit = _fit(workload_class, request, device, timer, share)
    fit["neighbours"] = neighbours
    calibrated = Calibrated(workload, fit)
    why = precisions.native_reason(request.precision, device)
    if why is not None:
        reference_share = max(share, workload_class.spec.default_duration / min_iterations)
        _compare(calibrated, workload_class, device, timer, why=why, share=reference_share)
    return calibrated


def _fit(
    workload_class: type[Workload],
    request: Request,
    device: DeviceInfo,
    timer: Timer,
    share: float,
) -> tuple[Workload, float, dict[str, Any]]:
    def limit(shrink: int) -> float:
        return share if shrink == 0 else share * SPARE

    shrink = workload_class.max_shrink
    current = workload_class(replace(request, shrink=shrink), device)
    seconds = trial_seconds(current, timer, limit(shrink))
    trials = [{"size": current.request.size_label, "seconds": seconds}]
    while shrink > 0 and seconds <= limit(shrink):
        candidate = workload_class(replace(request, shrink=shrink - 1), device)
        predicted = seconds * step_work(candidate) / step_work(current)
        if predicted > REACH * limit(shrink - 1):
            break
        candidate_seconds = trial_seconds(candidate, timer, limit(shrink - 1))
        trials.append({"size": candidate.request.size_label, "seconds": candidate_seconds})
        if candidate_seconds > limit(shrink - 1):
            break
        current.close()
        current, seconds, shrink = candidate, candidate_seconds, shrink - 1
    fit = {
        "share_seconds": share,
        "iteration_seconds": seconds,
        "fits": seconds <= limit(shrink),
        "trials": trials,
    }
    return current, seconds, fit


def _compare(
    calibrated: Calibrated,
    workload_class: type[Workload],
    device: DeviceInfo,
    timer: Timer,
    *,
    why: str,
    share: float,
) -> None:
    """Size each native precision as its default probe would be (``share`` of a second per
    iteration, or this run's where that is longer); the fastest is the reference."""
    request = calibrated.workload.request
    assert calibrated.fit is not None
    rate = step_work(calibrated.workload) / max(calibrated.fit["iteration_seconds"], TICK_SECONDS)
    best: tuple[float, str, str] | None = None
    for other in workload_class.spec.precisions:
        if (
            other == request.precision
            or workload_class.unsupported_reason(device, other, request.optimization) is not None
            or precisions.native_reason(other, device) is not None
        ):
            continue
        precisions.configure(other)
        try:
            asked = replace(request, precision=other, shrink=0)
            reference, seconds, _ = _fit(workload_class, asked, device, timer, share)
            other_rate = step_work(reference) / max(seconds, TICK_SECONDS)
            reference.close()
        finally:
            precisions.configure(request.precision)
        if best is None or other_rate > best[0]:
            best = (other_rate, other, reference.request.size_label)
    if best is None:
        return
    ratio = rate / best[0]
    calibrated.reference = {"precision": best[1], "ratio": ratio, "size": best[2]}
    if ratio < SLOW_PATH_RATIO:
        calibrated.slow_path = f"{why}: {ratio:.3g} of {best[1]}"


def trial_seconds(workload: Workload, timer: Timer, limit: float) -> float:
    """The estimate of a sustained step: the slowest of ``TRIAL_STEPS`` timed steps after a
    first one (which chooses kernels and allocates), times ``MARGIN``; the first alone where it
    is already over ``limit``. Not the fastest: a run's iterations are slower than cold trial
    steps, and a size kept on its best step leaves no room for that."""
    steps = workload.steps()
    try:
        start, end = timer.measure(next(steps).run)
        if end - start > limit:
            return end - start
        slowest = 0.0
        for _ in range(TRIAL_STEPS):
            start, end = timer.measure(next(steps).run)
            slowest = max(slowest, end - start)
    finally:
        steps.close()
    return slowest * MARGIN


def replan(
    workload: Workload, records: Sequence[Record], *, now: float, deadline: float, minimum: int
) -> dict[str, Any] | None:
    """What the run records of a re-plan to the next smaller size, where the pace of
    ``records`` (the run's latest iterations, all of this size; the time from the first one's
    start to ``now`` over their count, so what runs between iterations counts too) does not
    reach ``minimum`` by ``deadline``; None where it does, or where the deadline has passed (a
    new size would get one iteration)."""
    pace = max(now - records[0].start, TICK_SECONDS) / len(records)
    projected = len(records) + max(deadline - now, 0.0) / pace
    if projected >= minimum or now >= deadline:
        return None
    return {
        "from_size": workload.request.size_label,
        "size": replace(workload.request, shrink=workload.request.shrink + 1).size_label,
        "at": now,
        "iteration_seconds": pace,
        "projected_iterations": projected,
        "discarded": [{"start": r.start, "end": r.end, "work": r.work} for r in records],
    }


def checked(records: Sequence[Record], share: float) -> bool:
    """Whether a size has run long enough for its pace to be judged: ``CHECK_ITERATIONS``
    iterations, or that many of the duration's shares of one iteration where sooner."""
    span = records[-1].end - records[0].start
    return len(records) >= CHECK_ITERATIONS or span >= CHECK_ITERATIONS * share


def shrunk(workload: Workload) -> Workload:
    """The same problem one level smaller (``Request.shrink`` + 1), built for the same device."""
    request = replace(workload.request, shrink=workload.request.shrink + 1)
    return type(workload)(request, workload.device)


def step_work(workload: Workload) -> float:
    steps = workload.steps()
    try:
        return next(steps).work
    finally:
        steps.close()
