"""Sampler loops: one thread per collector, each with its own interval and deadline-based sleep.

Deadlines advance by the interval from the previous deadline, not from the end of the previous
poll, so the sampling grid does not drift. A poll that overruns its slot makes the loop skip the
missed deadlines (counted) rather than poll in a burst to catch up. Every failure is isolated to
its loop and counted by kind; nothing a collector does can stop another collector. A collector
whose source is not installed on the node (``SourceUnavailable``: no NVIDIA driver) is absent,
not failing: nothing is counted for it. A loop whose poll has not finished for ``stall_after``
(every NVML call blocking) is stalled: it reads as down, and says so once in the log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from collectors.base import Collector, CollectorError, Sample, SourceUnavailable

log = logging.getLogger(__name__)

Sink = Callable[[Sample], None]


@dataclass(frozen=True, slots=True)
class LoopStatus:
    """What the exporter and /healthz know about one loop."""

    collector: str
    interval_seconds: float
    up: bool
    absent: str | None  # why the collector's source is not installed here; None where it is
    polls: int
    last_duration_seconds: float | None
    last_lag_seconds: float | None
    last_poll_timestamp: float | None
    missed_polls: int
    errors: dict[str, int]
    stalled: bool


class SamplerLoop:
    """Polls one collector on a fixed grid and hands each sample to every sink."""

    def __init__(
        self,
        collector: Collector,
        interval_seconds: float,
        sinks: Sequence[Sink],
        stall_seconds: float,
    ) -> None:
        self.collector = collector
        self.interval_seconds = interval_seconds
        self.stall_seconds = stall_seconds
        self._sinks = tuple(sinks)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"sampler-{collector.name}", daemon=True
        )
        self._lock = threading.Lock()
        self._up = False
        self._absent: str | None = None
        self._polls = 0
        self._missed = 0
        self._errors: Counter[str] = Counter()
        self._logged_kinds: set[str] = set()
        self._last_duration: float | None = None
        self._last_lag: float | None = None
        self._last_poll_wall: float | None = None
        self._last_progress = time.monotonic()
        self._stall_logged = False

    def start(self) -> None:
        self._last_progress = time.monotonic()
        self._thread.start()

    def request_stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def set_interval(self, seconds: float) -> None:
        """Poll every ``seconds`` from now on (a probe asks for ~10 Hz while it runs); the loop
        wakes at once and starts a new grid."""
        if seconds != self.interval_seconds:
            self.interval_seconds = seconds
            self._wake.set()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the loop to end; False if a poll is still stuck."""
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _count_error(self, kind: str, detail: str) -> None:
        with self._lock:
            self._errors[kind] += 1
        if kind not in self._logged_kinds:
            self._logged_kinds.add(kind)
            log.warning(
                "collector %s: %s (logged once per kind, counted always)",
                self.collector.name,
                detail,
            )

    def poll_once(self, lag: float = 0.0) -> None:
        started = time.monotonic()
        samples: Sequence[Sample] = ()
        up = True
        absent = None
        try:
            samples = self.collector.collect()
        except SourceUnavailable as exc:
            # Not a fault: the collector does not apply to this node (it logged so once).
            up = False
            absent = exc.reason
        except CollectorError as exc:
            up = False
            self._count_error("collect", str(exc))
        except Exception as exc:  # noqa: BLE001 - a collector bug costs one poll, not the loop
            up = False
            self._count_error(type(exc).__name__, f"unexpected {type(exc).__name__}: {exc}")
        # Up before the samples reach the sinks: a scrape in between must not show a poll's
        # readings beside the up of the poll before it (0 before the first).
        with self._lock:
            self._up = up
            self._absent = absent
        for sample in samples:
            for kind in sample.errors:
                self._count_error(kind, f"field error of kind {kind!r}")
            for sink in self._sinks:
                try:
                    sink(sample)
                except Exception as exc:  # noqa: BLE001 - a sink fault must not stop the sampling
                    self._count_error("sink", f"sink failed: {type(exc).__name__}: {exc}")
        finished = time.monotonic()
        with self._lock:
            self._polls += 1
            self._last_duration = finished - started
            self._last_lag = lag
            self._last_poll_wall = time.time()
            self._last_progress = finished

    def _run(self) -> None:
        deadline = time.monotonic()
        while not self._stop.is_set():
            self.poll_once(lag=max(0.0, time.monotonic() - deadline))
            deadline += self.interval_seconds
            now = time.monotonic()
            if now > deadline:
                skipped = int((now - deadline) // self.interval_seconds) + 1
                deadline += skipped * self.interval_seconds
                with self._lock:
                    self._missed += skipped
            if self._wake.wait(deadline - now):
                self._wake.clear()
                deadline = time.monotonic()

    @property
    def stall_after(self) -> float:
        """Seconds without a finished poll after which the loop counts as stalled; never less
        than three intervals, so a slow configured interval is not mistaken for a stall."""
        return max(self.stall_seconds, 3 * self.interval_seconds)

    def status(self) -> LoopStatus:
        with self._lock:
            stuck = time.monotonic() - self._last_progress
            stalled = stuck > self.stall_after
            if stalled != self._stall_logged:
                self._stall_logged = stalled
                if stalled:
                    log.error(
                        "collector %s: stalled, no poll finished for %.0f s (its calls block); "
                        "it reads as down and its devices' verdicts as unknown",
                        self.collector.name,
                        stuck,
                    )
                else:
                    log.warning("collector %s: polls again after a stall", self.collector.name)
            return LoopStatus(
                collector=self.collector.name,
                interval_seconds=self.interval_seconds,
                up=self._up and not stalled,
                absent=self._absent,
                polls=self._polls,
                last_duration_seconds=self._last_duration,
                last_lag_seconds=self._last_lag,
                last_poll_timestamp=self._last_poll_wall,
                missed_polls=self._missed,
                errors=dict(self._errors),
                stalled=stalled,
            )
