"""A spinner on standard error for a command that reads or draws for more than a second.

Shown only where standard error is a terminal (a person is waiting; a script or a pipe gets
nothing), and only once the work has taken ``AFTER_SECONDS``: a quick answer stays one clean
block of output. rich draws it (already a dependency: ``sustain probe``'s progress bars).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

AFTER_SECONDS = 1.0


@contextmanager
def working(what: str, *, after_seconds: float = AFTER_SECONDS) -> Iterator[None]:
    """``with working("reading the archive"): ...`` shows "reading the archive ..." with a
    spinner from ``after_seconds`` on, until the block ends."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    status = Console(stderr=True).status(f"{what} ...")
    started = threading.Event()
    lock = threading.Lock()
    done = False

    def show() -> None:
        nonlocal done
        with lock:
            if not done:
                status.start()
                started.set()

    timer = threading.Timer(after_seconds, show)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        with lock:
            done = True
            if started.is_set():
                status.stop()
