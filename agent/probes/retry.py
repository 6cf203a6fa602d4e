"""Skipped runs tried again soon, so that a busy start does not cost an hour.

A plan entry runs once an interval (an hour by default). Where its round finds a device busy (a
foreign process, a busy CPU, the duty cycle spent), the run is skipped, and without a retry the
next try is a whole interval later: a node that was busy for its first minutes had no result for
its first hour. Here the skipped runs are tried again after ``probing.skip_retry_seconds`` (60 s
by default), then after twice as long each time, for as long as the try comes before the entry's
next scheduled round (which takes over from there). A retry passes the same checks as any run (a
busy device, the duty-cycle budget): it only comes sooner.

Why a run was skipped is classed for ``sustain_probe_skips_total{reason}`` by ``SkipReason``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Literal

from apscheduler.schedulers.base import BaseScheduler
from apscheduler.triggers.date import DateTrigger

from agent.config.settings import ProbePlanEntry
from agent.probes.runner import ProbeRun, ProbeSpec

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
