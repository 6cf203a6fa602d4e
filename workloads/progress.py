"""A spinner on standard error for a command that reads, probes or draws for more than a second.

Shown only where standard error is a terminal (a person is waiting; a script or a pipe gets
nothing), and only once the work has taken ``AFTER_SECONDS``: a quick answer stays one clean
block of output. rich draws it (already a dependency: ``sustain probe``'s progress bars).

It lives with the workloads, the package that imports nothing of the others, so that both
``python -m workloads list`` and the agent's commands use it; it imports neither torch nor
rich until a spinner is due.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

AFTER_SECONDS = 1.0


class Spinner:
    """ "WHAT ..." with a spinner from ``after_seconds`` after ``start`` until ``stop``; nothing
    where standard error is not a terminal. ``stop`` may be called more than once."""

    def __init__(self, what: str, *, after_seconds: float = AFTER_SECONDS) -> None:
        self._what = what
        self._after = after_seconds
        self._lock = threading.Lock()
        self._status: Any = None
        self._done = False
        self._timer: threading.Timer | None = None

    def start(self) -> Spinner:
        if sys.stderr.isatty():
            self._timer = threading.Timer(self._after, self._show)
            self._timer.daemon = True
            self._timer.start()
        return self

    def _show(self) -> None:
        from rich.console import Console

        with self._lock:
            if not self._done:
                self._status = Console(stderr=True).status(f"{self._what} ...")
                self._status.start()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._done = True
            if self._status is not None:
                self._status.stop()
                self._status = None


@contextmanager
def working(what: str, *, after_seconds: float = AFTER_SECONDS) -> Iterator[None]:
    """``with working("reading the archive"): ...`` shows "reading the archive ..." with a
    spinner from ``after_seconds`` on, until the block ends."""
    spinner = Spinner(what, after_seconds=after_seconds).start()
    try:
        yield
    finally:
        spinner.stop()
