"""XID critical errors: NVML reports them only through a blocking wait on an event set.

The wait has its own thread, so that the sampler's polls never block on it; the collector gets
each XID through a callback, with the key of the device it came from.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pynvml

from collectors.nvml.library import Absent, CallFailed, DeviceLost, NvmlLibrary

log = logging.getLogger(__name__)

XID_WAIT_MS = 500


def handle_key(handle: Any) -> int | None:
    """The address behind a device handle: an event's handle is a new ctypes object for the same
    device, so handles are compared by this."""
    return ctypes.cast(handle, ctypes.c_void_p).value


class XidWatcher:
    """Waits on an NVML event set in its own thread, so the sampler never blocks on it."""

    def __init__(self, library: NvmlLibrary, on_xid: Callable[[int | None, int], None]) -> None:
        self._library = library
        self._on_xid = on_xid
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None

    def start(self, handles: Sequence[Any]) -> None:
        try:
            self._event_set = self._library.call(pynvml.nvmlEventSetCreate)
        except (Absent, CallFailed) as exc:
            log.info("XID events unavailable: %s", exc)
            return
        for handle in handles:
            self.register(handle)
        self._thread = threading.Thread(target=self._run, name="nvml-xid", daemon=True)
        self._thread.start()

    def register(self, handle: Any) -> None:
        if self._event_set is None:
            return
        try:
            supported = self._library.call(pynvml.nvmlDeviceGetSupportedEventTypes, handle)
            if supported & pynvml.nvmlEventTypeXidCriticalError:
                self._library.call(
                    pynvml.nvmlDeviceRegisterEvents,
                    handle,
                    pynvml.nvmlEventTypeXidCriticalError,
                    self._event_set,
                )
        except (Absent, CallFailed, DeviceLost) as exc:
            log.info("XID events not registered for a device: %s", exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._library.call(pynvml.nvmlEventSetWait_v2, self._event_set, XID_WAIT_MS)
            except CallFailed as exc:
                if exc.kind != "timeout":
                    self._stop.wait(1.0)  # do not spin on a persistent failure
                continue
            except (Absent, DeviceLost):
                self._stop.wait(1.0)
                continue
            if data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                self._on_xid(handle_key(data.device), int(data.eventData))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(XID_WAIT_MS / 1000 * 4)
        if self._event_set is not None:
            with contextlib.suppress(Absent, CallFailed):
                self._library.call(pynvml.nvmlEventSetFree, self._event_set)
            self._event_set = None
