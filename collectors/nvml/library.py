"""The one place that knows what an NVML error means: the collector and the stack snapshot share it.

Every NVML call goes through ``NvmlLibrary.call``: NotSupported, NoPermission and FunctionNotFound
(an older driver) make the field absent for that device — never 0, never a sentinel — and
FunctionNotFound is logged once per function; GpuIsLost marks the device unhealthy; anything else
(a timeout, an unknown error) costs that field for that sample and is counted. NVML is started
once per process, lazily and under a lock, and shut down at exit.

An older nvidia-ml-py is an older driver too: a function the bindings lack (``binding``) is
answered like the driver's FunctionNotFound — one log line, its fields absent, the older fallback
used — never an AttributeError that fails the poll.

Where NVML is not installed (no libnvidia-ml, or its kernel driver not loaded: a CPU-only node)
the source is absent, which is not a fault: said once in the log, looked for again on a slow
backoff, and never counted as an error. A driver that is there and fails to start is a fault.
"""

from __future__ import annotations

import atexit
import functools
import importlib.metadata
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pynvml

from collectors.base import CollectorError, SourceUnavailable

log = logging.getLogger(__name__)

# Where NVML is not installed, it is looked for again after ABSENT_RETRY_SECONDS (the default of
# nvml.absent_retry_seconds), the wait doubling up to ABSENT_RETRY_MAX_SECONDS: a driver loaded
# after the agent started (a GPU operator's driver container) is picked up within the cap, and a
# CPU-only node pays one dlopen every few minutes.
ABSENT_RETRY_SECONDS = 60.0
ABSENT_RETRY_MAX_SECONDS = 300.0
# How often a driver that is there but failed to start is tried again.
INIT_RETRY_SECONDS = 60.0

# NVML's answers that mean "not installed on this node", and the reason each is exported as.
_NOT_INSTALLED = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: "library_not_found",
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "driver_not_loaded",
}

_ERROR_KINDS = {
    pynvml.NVML_ERROR_TIMEOUT: "timeout",
    pynvml.NVML_ERROR_UNKNOWN: "unknown",
    pynvml.NVML_ERROR_INSUFFICIENT_SIZE: "insufficient_size",
    pynvml.NVML_ERROR_INVALID_ARGUMENT: "invalid_argument",
    pynvml.NVML_ERROR_UNINITIALIZED: "uninitialized",
}
_ABSENT = frozenset(
    {
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
        pynvml.NVML_ERROR_NO_DATA,
        pynvml.NVML_ERROR_NOT_FOUND,  # e.g. a MIG device slot with no instance in it
    }
)
_LOST = frozenset({pynvml.NVML_ERROR_GPU_IS_LOST})


class Absent(Exception):
    """The field does not exist for this device (not supported, no permission, no function)."""


class Refused(Absent):
    """NVML_ERROR_NO_PERMISSION: the field exists but this process may not read it (GPM and
    per-process data in a non-privileged container). Asking again gets the same answer."""


class FunctionMissing(Absent):
    """The driver lacks the function: a caller with an older fallback may use it."""


class DeviceLost(Exception):
    """NVML says the GPU is lost (fallen off the bus)."""


class _BindingLacks(Exception):
    """The installed nvidia-ml-py predates the function: the stand-in ``binding`` gave raises it."""


class CallFailed(Exception):
    """A transient NVML failure; ``kind`` names it for the error counter."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def text(value: Any) -> str:
    """An NVML string as text: pynvml gives bytes or str depending on its version."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def transient_kind(code: int) -> str | None:
    """The error-counter kind of an NVML return code that is a transient failure (a field
    value's ``nvmlReturn``), or None for success, an absent field or a lost GPU."""
    if code == pynvml.NVML_SUCCESS or code in _ABSENT or code in _LOST:
        return None
    if code in (pynvml.NVML_ERROR_NO_PERMISSION, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
        return None
    return _ERROR_KINDS.get(code, f"nvml_{code}")


def binding_version() -> str:
    """The installed nvidia-ml-py's version, for the log line about a function it lacks."""
    try:
        return importlib.metadata.version("nvidia-ml-py")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def binding(name: str) -> Callable[..., Any]:
    """pynvml's function ``name``; where the installed nvidia-ml-py predates it, a stand-in that
    ``NvmlLibrary.call`` answers like the driver's FunctionNotFound. For the functions newer than
    the oldest bindings the collector still runs on, 12.535 (nvmlDeviceGetTemperatureV came in
    12.570, nvmlDeviceGetNumaNodeId in 12.550); pyproject's floor is the first with them all."""
    function: Callable[..., Any] | None = getattr(pynvml, name, None)
    return function if function is not None else _lacking(name)


@functools.cache
def _lacking(name: str) -> Callable[..., Any]:
    def lacking(*_: Any) -> Any:
        raise _BindingLacks(name)

    lacking.__name__ = name
    return lacking


def cuda_version_text(version: int) -> str:
    """NVML's CUDA driver version integer as people write it: 12040 -> "12.4" (major x 1000 +
    minor x 10, nvmlSystemGetCudaDriverVersion), the one format of the metrics and the stack."""
    return f"{version // 1000}.{version % 1000 // 10}"


class NvmlLibrary:
    """The choke point: lazy init under a lock, shutdown at exit, one meaning per error code.

    ``clock`` (monotonic seconds) times the retries of a failed start; tests pass their own.
    ``absent_retry_seconds`` is the first wait before NVML is looked for again where it is not
    installed (``nvml.absent_retry_seconds``); the wait doubles from there up to
    ``ABSENT_RETRY_MAX_SECONDS``.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        absent_retry_seconds: float = ABSENT_RETRY_SECONDS,
    ) -> None:
        self._clock = clock
        self._absent_retry_seconds = absent_retry_seconds
        self._lock = threading.Lock()
        self._started = False
        self._missing: set[str] = set()
        self._retry_at: float | None = None
        self._failure = ""
        self._absent: str | None = None  # the reason NVML is not installed, while it is not
        self._absent_wait = 0.0

    def start(self) -> bool:
        """Initialise NVML once; True the first time it succeeds.

        Until then it raises ``SourceUnavailable`` while NVML is not installed here and
        ``CollectorError`` while a driver that is there fails to start; between two attempts
        the last answer is given again without asking NVML.
        """
        with self._lock:
            if self._started:
                return False
            now = self._clock()
            if self._retry_at is not None and now < self._retry_at:
                raise self._unavailable()
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as exc:
                self._failed(exc, now)
                raise self._unavailable() from None
            self._started = True
            self._retry_at = None
            self._absent = None
            self._absent_wait = 0.0
            atexit.register(self.shutdown)
            return True

    def _failed(self, exc: pynvml.NVMLError, now: float) -> None:
        reason = _NOT_INSTALLED.get(exc.value)
        if reason is None:
            # A fault: the sampler counts it at every poll and logs it once.
            self._failure = f"NVML failed to start: {exc}"
            self._absent = None
            self._absent_wait = 0.0
            self._retry_at = now + INIT_RETRY_SECONDS
            return
        self._failure = f"NVML unavailable: {exc}"
        if self._absent_wait:
            longest = max(ABSENT_RETRY_MAX_SECONDS, self._absent_retry_seconds)
            self._absent_wait = min(2 * self._absent_wait, longest)
        else:
            self._absent_wait = self._absent_retry_seconds
        self._retry_at = now + self._absent_wait
        if reason != self._absent:
            log.info(
                "%s (%s): no NVIDIA driver here, no GPU telemetry (not an error); looked for "
                "again after %.0f s, then less often, at least once every %.0f s",
                self._failure,
                reason,
                self._absent_wait,
                ABSENT_RETRY_MAX_SECONDS,
            )
        else:
            log.debug("%s; looked for again in %.0f s", self._failure, self._absent_wait)
        self._absent = reason

    def _unavailable(self) -> CollectorError:
        if self._absent is not None:
            return SourceUnavailable(self._failure, self._absent)
        return CollectorError(self._failure)

    def shutdown(self) -> None:
        with self._lock:
            if not self._started:
                return
            self._started = False
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as exc:
                log.debug("nvmlShutdown: %s", exc)

    def call(self, function: Callable[..., Any], *args: Any) -> Any:
        name = getattr(function, "__name__", repr(function))
        if name in self._missing:
            raise FunctionMissing(name)
        try:
            return function(*args)
        except _BindingLacks:
            if name not in self._missing:
                self._missing.add(name)
                log.info(
                    "nvidia-ml-py %s lacks %s: its fields are absent (a newer nvidia-ml-py has it)",
                    binding_version(),
                    name,
                )
            raise FunctionMissing(name) from None
        except pynvml.NVMLError as exc:
            code = exc.value
            if code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                if name not in self._missing:
                    self._missing.add(name)
                    log.info("NVML driver lacks %s: its fields are absent", name)
                raise FunctionMissing(name) from None
            if code == pynvml.NVML_ERROR_NO_PERMISSION:
                raise Refused(name) from None
            if code in _ABSENT:
                raise Absent(name) from None
            if code in _LOST:
                raise DeviceLost(str(exc)) from None
            raise CallFailed(_ERROR_KINDS.get(code, f"nvml_{code}")) from None

    def call_first(self, *calls: tuple[Callable[..., Any], tuple[Any, ...]]) -> Any:
        """The first call whose function the driver has: the current API, then its fallback."""
        for function, args in calls[:-1]:
            try:
                return self.call(function, *args)
            except FunctionMissing:
                continue
        function, args = calls[-1]
        return self.call(function, *args)
