"""Iteration timing as wall-clock Unix seconds, so the agent can line iterations up with telemetry.

Two clocks meet here. The agent samples telemetry against the wall clock, but the wall clock is
neither monotonic nor fine-grained enough to time an iteration, and on a GPU the host clock does
not even see when the work ran. So each timer takes one wall-clock reference and expresses its
own precise readings relative to it:

- ``perf_counter`` (CPU, where torch ops are synchronous): one ``time.time()`` /
  ``time.perf_counter()`` pair is read back to back at construction; a perf_counter reading ``p``
  becomes ``wall0 + (p - perf0)``. Times are monotonic and share one offset error of a few
  microseconds.
- ``cuda_event`` (GPU): at construction the device is synchronised, an anchor event is recorded
  and waited for, and the wall time is read right after it completes. Each iteration is bracketed
  by a start and an end event on the current stream. ``elapsed_time`` is a float32 of
  milliseconds (torch.cuda.Event.elapsed_time; cudaEventElapsedTime), whose step grows with the
  interval: 2 us 20 s into a run, 0.25 ms an hour in. So a duration is never a difference of two
  readings against the anchor: the start is ``anchor_wall + anchor.elapsed_time(start) / 1000``
  (only its offset loses precision, at most half a step) and the end is the start plus
  ``start.elapsed_time(end) / 1000``, the device's own execution time, exact to the event
  resolution (about 0.5 us) however long the run. A start that the rounding puts before the
  previous end is moved to that end, so times stay monotonic. The common offset error is the
  synchronise latency (microseconds). Waiting for the end event each iteration is what lets the
  child report iterations as they finish.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch


class Timer(ABC):
    name: str

    def __init__(self) -> None:
        self._wall0 = time.time()
        self._perf0 = time.perf_counter()

    def now(self) -> float:
        """Host wall-clock time on the monotonic scale of this timer, for deadline checks."""
        return self._wall0 + (time.perf_counter() - self._perf0)

    @abstractmethod
    def measure(self, work: Callable[[], None]) -> tuple[float, float]:
        """Run work once; return when it started and ended, in Unix seconds."""


class PerfCounterTimer(Timer):
    name = "perf_counter"

    def measure(self, work: Callable[[], None]) -> tuple[float, float]:
        start = time.perf_counter()
        work()
        end = time.perf_counter()
        return self._wall0 + (start - self._perf0), self._wall0 + (end - self._perf0)


class CudaEventTimer(Timer):
    # Only a real GPU runs this class (tests/test_workload_defects.py stands in for the events); it
    # follows the PyTorch docs of torch.cuda.Event: record(), synchronize(), and elapsed_time(),
    # which needs enable_timing=True on both events.
    name = "cuda_event"

    def __init__(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)
        self._anchor = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        self._anchor.record()
        self._anchor.synchronize()
        super().__init__()
        self._anchor_wall = self._wall0
        self._last_end = self._wall0

    def measure(self, work: Callable[[], None]) -> tuple[float, float]:
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        work()
        end.record()
        end.synchronize()
        # The offset from the anchor, the duration from this iteration's own pair of events.
        offset = self._anchor.elapsed_time(start) / 1e3
        started = max(self._anchor_wall + offset, self._last_end)
        self._last_end = started + start.elapsed_time(end) / 1e3
        return started, self._last_end


def for_device(device: torch.device) -> Timer:
    """CUDA events on a GPU, perf_counter elsewhere: the one place that choice is made."""
    if device.type == "cuda":
        return CudaEventTimer(device)  # GPU-only: not exercised on CPU
    return PerfCounterTimer()
