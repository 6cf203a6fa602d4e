"""One agent per data directory: ``sustain.lock`` in it, held with ``flock`` while the agent runs.

Two agents on one data directory would write the same spool and local archive and record every
``health_change`` twice. The second one is refused at start-up, before it opens either. The lock is
the kernel's: it goes with the process, so a killed agent leaves no stale lock behind, only the
file with its pid, which the next agent overwrites. The file stays when the agent stops (removing
it would let a third agent lock a new file while the second still holds the old one); only a
start-up that fails leaves no trace: the directories the lock created are removed again, so that,
say, a port in use is reported without a data directory left behind.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = "sustain.lock"


class DataDirInUse(Exception):
    """Another agent holds the data directory, or its lock file cannot be used; one line."""


class DataDirLock:
    """Held from ``acquire`` (which refuses with ``DataDirInUse``) to ``release``."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / LOCK_NAME
        self._fd: int | None = None
        self._created: list[Path] = []  # directories acquire() made, outermost first

    def acquire(self) -> None:
        missing = [d for d in (self.path.parent, *self.path.parent.parents) if not d.exists()]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._created = missing[::-1]
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise DataDirInUse(
                f"cannot lock the data directory {self.path.parent}: {exc.strerror or exc}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            raise DataDirInUse(
                f"another sustain agent (pid {holder or 'unknown'}) runs on the data directory "
                f"{self.path.parent} (it holds {self.path}); give this one its own "
                "agent.data_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None

    def abandon(self) -> None:
        """Release after a failed start-up: the directories acquire() created are removed again
        where nothing but the lock file is in them."""
        self.release()
        if not self._created:
            return
        self.path.unlink(missing_ok=True)
        for directory in reversed(self._created):
            try:
                directory.rmdir()
            except OSError:  # something else was written there: it stays
                return
