"""Skipped runs: why (classed for the skip metric) and tried again soon, so that a busy start
does not cost an hour.

A plan entry runs once an interval (an hour by default). Where its round finds a device busy (a
foreign process, a busy CPU, the duty cycle spent), the run is skipped, and without a retry the
next try is a whole interval later: a node that was busy for its first minutes had no result for
its first hour. Here the skipped runs are tried again after ``probing.skip_retry_seconds`` (60 s
by default), then after twice as long each time, for as long as the try comes before the entry's
next scheduled round (which takes over from there). A retry passes the same checks as any run (a
busy device, the duty-cycle budget): it only comes sooner.

Why a run was skipped is classed for ``sustain_probe_skips_total{reason}`` by ``SkipReason``;
``mig_busy`` says why a MIG GPU is busy (or cannot be told to be idle).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Literal

from apscheduler.schedulers.base import BaseScheduler
from apscheduler.triggers.date import DateTrigger

from agent.config.settings import ProbePlanEntry
from agent.probes.runner import ProbeDevice, ProbeRun, ProbeSpec
from collectors.base import Sample

log = logging.getLogger(__name__)

SkipKind = Literal["duty_cycle", "foreign_processes", "gpu_busy", "cpu_busy", "mig_unknown"]
SKIP_KINDS: tuple[SkipKind, ...] = (
    "duty_cycle",
    "foreign_processes",
    "gpu_busy",
    "cpu_busy",
    "mig_unknown",
)


class SkipReason(str):
    """Why a run is skipped, in words (what the archive and the log say); ``kind`` is its class,
    the ``reason`` label of ``sustain_probe_skips_total``."""

    kind: SkipKind

    def __new__(cls, text: str, kind: SkipKind) -> SkipReason:
        reason = super().__new__(cls, text)
        reason.kind = kind
        return reason


def skip_kind(reason: str) -> str:
    """The class of a skipped run's reason; "other" for a reason given as plain words."""
    return reason.kind if isinstance(reason, SkipReason) else "other"


def mig_busy(
    latest: Iterable[Sample], device: ProbeDevice, skip_foreign_processes: bool
) -> SkipReason | None:
    """A MIG GPU is busy when any of its MIG devices has work: its utilization reads N/A,
    so the processes decide, on the GPU's list or, where NVML refuses that one, the
    instances' lists. When neither can be read, whether it is busy cannot be told: skipped,
    saying so, rather than probed blindly."""
    if not skip_foreign_processes:
        return None
    gpu = device.gpu
    whole: float | None = None
    instances: dict[str, float | None] = {}
    for sample in latest:
        for reading in sample.readings:
            labels = dict(reading.labels)
            if sample.device == gpu and reading.field == "gpu_foreign_compute_processes":
                whole = reading.value
            elif reading.field == "gpu_mig_info" and labels.get("parent") == gpu:
                instances.setdefault(labels["mig_instance"], None)
            elif reading.field == "gpu_mig_foreign_compute_processes" and (
                labels.get("parent") == gpu
            ):
                instances[labels["mig_instance"]] = reading.value
    busy = {gi: int(count) for gi, count in sorted(instances.items()) if count}
    if busy:
        where = ", ".join(f"{count} on MIG {gi}" for gi, count in busy.items())
        return SkipReason(
            f"{sum(busy.values())} foreign compute process(es) on GPU {device.label} "
            f"(MIG mode: {where})",
            "foreign_processes",
        )
    if whole:
        return SkipReason(
            f"{int(whole)} foreign compute process(es) on GPU {device.label} (MIG mode)",
            "foreign_processes",
        )
    if whole is None and (not instances or None in instances.values()):
        return SkipReason(
            f"GPU {device.label} is in MIG mode, where utilization reads N/A, and NVML "
            "refused its process lists: whether it is busy cannot be told",
            "mig_unknown",
        )
    return None


class SkippedRetry:
    """Tries the skipped runs of a round again, sooner than the entry's next round."""

    def __init__(
        self,
        scheduler: BaseScheduler,
        run_one: Callable[[ProbeSpec], ProbeRun],
        first_delay_seconds: float,
        stopping: threading.Event,
    ) -> None:
        self._scheduler = scheduler
        self._run_one = run_one
        self._first_delay = first_delay_seconds
        self._stopping = stopping

    def after_round(
        self, entry: ProbePlanEntry, runs: Sequence[ProbeRun], job_id: str | None
    ) -> None:
        """After a scheduled round of ``entry`` (its job ``job_id``): its skipped solo runs are
        tried again after the first delay."""
        self._again(entry, runs, job_id, self._first_delay)

    def _again(
        self, entry: ProbePlanEntry, runs: Sequence[ProbeRun], job_id: str | None, delay: float
    ) -> None:
        specs = [
            run.spec for run in runs if run.outcome == "skipped" and run.spec.scope == "device"
        ]
        if not specs or delay <= 0 or self._stopping.is_set():
            return
        at = time.time() + delay
        job = None if job_id is None else self._scheduler.get_job(job_id)
        next_round = None if job is None or job.next_run_time is None else job.next_run_time
        if next_round is not None and at >= next_round.timestamp():
            return  # the next round comes first
        log.info(
            "probe %s: %d skipped run(s) tried again in %.0f s", entry.workload, len(specs), delay
        )
        self._scheduler.add_job(
            self._retry,
            DateTrigger(run_date=datetime.fromtimestamp(at, UTC)),
            args=(entry, specs, job_id, delay),
            id=f"probe-retry-{uuid.uuid4().hex}",
            misfire_grace_time=None,
        )

    def _retry(
        self, entry: ProbePlanEntry, specs: Sequence[ProbeSpec], job_id: str | None, delay: float
    ) -> None:
        runs = []
        for spec in specs:
            if self._stopping.is_set():
                return
            runs.append(self._run_one(spec))
        self._again(entry, runs, job_id, 2 * delay)
